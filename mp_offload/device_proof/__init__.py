"""The device proof (``scripts/device_check.sh``): the checks only a GPU can settle, as
stages that each write their named checks into ``$OUT``, merged into ``summary.json``.

``python -m mp_offload.device_proof STAGE --out DIR [--rehearsal]``; with ``--rehearsal``
every stage runs at a tiny size with the CPU as the device (gloo, the CPU copy path,
calibration on the CPU), so the stages, parsing, judging and summary are proven on any
machine before a GPU minute is spent.
"""

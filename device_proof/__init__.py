"""The device proof (``scripts/device_check.sh``): what only a GPU can settle, in one
process, in order of value under one deadline, each check a line of ``summary.txt``.

``python -m device_proof --out DIR [--rehearsal] [--deadline-s S] [--sections ...]``; with
``--rehearsal`` the same checks, in the same order and with the same lines, run at tiny
sizes with the CPU as the device, so the proof itself is proven before a GPU minute is
spent. Not part of the library: nothing in ``mp_offload`` imports it.
"""

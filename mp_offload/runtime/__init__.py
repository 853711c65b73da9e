"""What every rank's process does around the training itself (no model, no optimizer):

distributed.py  start-up of the process groups, and the one-line error every rank
                agrees on (``fail``, ``agreed``, ``first_error``)
early_exit.py   ending on an error before the group exists, without torch
logger.py       the one logger and the per-iteration metrics
phase_timer.py  per-iteration phase times (CUDA events on a GPU, wall time on the CPU)
cpu_threads.py  the CPU-thread rule of a rank; idle OpenMP threads sleep
numa.py         each rank's threads and host memory on its GPU's socket
stopping.py     SIGINT/SIGTERM: finish the step, save, exit; the stalled-peer watchdog
lifeline.py     workers end with their launcher
faults.py       fault injection for the tests (does nothing without its variables)
"""

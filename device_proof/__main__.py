"""``python -m device_proof``: see ``device_proof/run.py``."""

import os
import sys

# cuBLAS reads it when its first handle is made: deterministic GEMMs for the bitwise checks
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from .run import main  # noqa: E402

sys.exit(main())

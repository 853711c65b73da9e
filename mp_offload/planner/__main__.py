"""``python -m mp_offload.planner``: the planner's command line (the same as
``python -m mp_offload.plan``; see ``planner/cli.py``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

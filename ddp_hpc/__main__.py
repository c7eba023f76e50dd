"""``python -m ddp_hpc``: the same as the ``ddp-hpc`` command."""

import sys

from ddp_hpc.cli import main

sys.exit(main())

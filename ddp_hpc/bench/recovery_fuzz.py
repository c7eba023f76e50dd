"""``python -m ddp_hpc.bench.recovery_fuzz --cases 200 --seed S [--jobs 1] [--replay CASE_SEED]
[--out DIR]``: in-job recovery under drawn models, loops and faults, each end compared bit
for bit with the same case uninterrupted (``bench/fuzz/``; docs/reliability.md)."""

import sys

from ddp_hpc.bench.fuzz.runner import main

if __name__ == "__main__":
    sys.exit(main())

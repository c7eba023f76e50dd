"""``python -m ddp_hpc.bench.recovery_fuzz --cases 200 --seed S [--jobs 1] [--replay CASE_SEED]
[--out DIR]``: in-job recovery under drawn models, loops and faults, each end compared bit
for bit with the same case uninterrupted (``bench/fuzz/``; docs/reliability.md)."""

import signal
import sys

from ddp_hpc.bench.fuzz.runner import main


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (a `timeout`, a scheduler) ends the running launches as Ctrl-C does


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    sys.exit(main())

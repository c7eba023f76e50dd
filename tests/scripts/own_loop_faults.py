"""Run a loop script (argv[1], e.g. examples/resumable_loop.py) with a fault from the
environment, injected at the Checkpointer's per-step call, for tests/test_own_loop.py:

- FAULT_KILL_RANK + FAULT_AT_STEP: that rank SIGKILLs itself right after step N, once per
  FAULT_MARKER file (a restarted run goes through).
- FAULT_SIGNAL_AT_STEP: rank 0 sends itself SIGUSR2 right after step N, once per FAULT_MARKER.
- Every rank prints what ``restore`` restored ("rank R: restored PATH at step N").
- RECORD_IDS=FOLDER: every rank appends "epoch id" for each sample its sampler hands out
  (num_workers=0: fetched just before it is trained) to FOLDER/rank-R.txt.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from ddp_hpc.engine.checkpointer import Checkpointer
from ddp_hpc.engine.sampler import ResumableSampler


def _once(marker: str) -> bool:
    try:
        Path(marker).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _inject() -> None:
    real_step_done = Checkpointer.step_done
    kill_rank, at_step = os.environ.get("FAULT_KILL_RANK"), os.environ.get("FAULT_AT_STEP")
    signal_step, marker = os.environ.get("FAULT_SIGNAL_AT_STEP"), os.environ.get("FAULT_MARKER", "")

    def step_done(self, batches: int = 1):
        path = real_step_done(self, batches)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if kill_rank is not None and rank == int(kill_rank) and self.step == int(at_step) and _once(marker):
            os.kill(os.getpid(), signal.SIGKILL)
        if signal_step is not None and rank == 0 and self.step == int(signal_step) and _once(marker):
            os.kill(os.getpid(), signal.SIGUSR2)
        return path

    Checkpointer.step_done = step_done

    real_restore = Checkpointer.restore

    def restore(self):
        path = real_restore(self)
        print(f"rank {self.group.rank}: restored {path} at step {self.step}", file=sys.stderr, flush=True)
        return path

    Checkpointer.restore = restore

    folder = os.environ.get("RECORD_IDS")
    if folder:
        real_iter = ResumableSampler.__iter__

        def recording_iter(self):
            with open(Path(folder) / f"rank-{self.rank}.txt", "a") as out:
                for index in real_iter(self):
                    out.write(f"{self.epoch} {index}\n")
                    out.flush()
                    yield index

        ResumableSampler.__iter__ = recording_iter


if __name__ == "__main__":
    _inject()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")

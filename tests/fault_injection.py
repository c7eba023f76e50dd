"""Callbacks that break a run on purpose, named in test configs' ``callbacks`` list."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ddp_hpc.training import Callback


class KillLaunchAfterCheckpoint(Callback):
    """SIGKILL the whole launch (the process group of torchrun/mpiexec and every rank)
    right after rank 0 has written the checkpoint of ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_checkpoint_saved(self, trainer, path: Path) -> None:
        if trainer.progress.global_step == self.step:
            os.killpg(os.getpgrp(), signal.SIGKILL)


class _AtStep(Callback):
    def __init__(self, rank: int, step: int, marker: str = "") -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def hit(self, trainer) -> bool:
        if trainer.ctx.rank != self.rank or trainer.progress.global_step != self.step:
            return False
        if self.marker:
            Path(self.marker).write_text(repr(time.time()))
        return True


class KillRankAtStep(_AtStep):
    """SIGKILL one rank (as the OOM killer would) right after ``step``."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            os.kill(os.getpid(), signal.SIGKILL)


class RaiseOnRankAtStep(_AtStep):
    """An exception in one rank's training code."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            raise RuntimeError(f"injected failure on rank {self.rank}")


class HangRankAtStep(_AtStep):
    """One rank stops making progress (stuck in user code): its peers wait in a collective."""

    def on_step_end(self, trainer) -> None:
        if self.hit(trainer):
            time.sleep(3600)

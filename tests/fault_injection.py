"""Callbacks that break a run on purpose, named in test configs' ``callbacks`` list."""

from __future__ import annotations

import os
import signal
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

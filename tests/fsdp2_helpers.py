"""A callback for the fsdp2 resume test (tests/ is on PYTHONPATH of its ranks):
``RecordLosses`` records the whole training set's loss after every step of ``RecordingJob``."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ddp_hpc.training import Callback


class RecordLosses(Callback):
    """After every step, the loss of the whole training set (every rank computes it: under
    fsdp2 a forward is collective); rank 0 appends ``global_step loss`` to a file per process."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_step_end(self, trainer) -> None:
        inputs, targets = trainer.job.build_datasets().train.tensors
        size = trainer.job.size
        with torch.no_grad():
            loss = float(nn.functional.mse_loss(trainer.model(inputs / size), targets / size))
        if trainer.ctx.is_rank_zero:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"losses-{os.getpid()}.txt", "a") as handle:
                handle.write(f"{trainer.progress.global_step} {loss!r}\n")


def read_losses(folder: Path) -> dict[int, float]:
    """global step -> rank 0's loss at that step, over every file in ``folder``."""
    losses: dict[int, float] = {}
    for path in folder.glob("losses-*.txt"):
        for line in path.read_text().splitlines():
            step, loss = line.split()
            losses[int(step)] = float(loss)
    return losses

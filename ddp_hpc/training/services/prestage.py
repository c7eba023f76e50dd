"""``checkpoint.async``: the first checkpoint's host memory, allocated ahead of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_hpc.training.callbacks import Callback

if TYPE_CHECKING:
    from ddp_hpc.training.trainer import Trainer


class Prestage(Callback):
    """After the first step (the optimizer then has its state), rank 0's background writer
    allocates the host buffers of a checkpoint in the background, so that even the first
    checkpoint's stall is a copy, not an allocation."""

    def __init__(self) -> None:
        self.done = False

    def on_step_end(self, trainer: Trainer) -> None:
        if not self.done:
            self.done = True
            trainer.state.prestage()

"""``checkpoint.async``: the first checkpoint's host memory, allocated ahead of it."""

from __future__ import annotations

from ddp_hpc.training.callbacks import Callback, TrainerView


class Prestage(Callback):
    """After the first step (the optimizer then has its state), rank 0's background writer
    allocates the host buffers of a checkpoint in the background, so that even the first
    checkpoint's stall is a copy, not an allocation."""

    def __init__(self) -> None:
        self.done = False

    def on_step_end(self, trainer: TrainerView) -> None:
        if not self.done:
            self.done = True
            trainer.state.prestage()

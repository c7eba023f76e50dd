"""``distributed.weights_check_every``: the Trainer's hook for ``ddp_hpc.engine.consistency``."""

from __future__ import annotations

from ddp_hpc.engine.consistency import WeightsCheck
from ddp_hpc.training.callbacks import Callback, TrainerView


class WeightsCheckCallback(Callback):
    """After every N-th optimizer step, all ranks compare a hash of their weights; a rank
    whose weights differ ends the job (``WeightsDivergedError`` names it, its host and the step)."""

    def __init__(self, every: int) -> None:
        self.check = WeightsCheck(every)

    def on_step_end(self, trainer: TrainerView) -> None:
        self.check.after_step(trainer.ddp_model, trainer.progress.global_step)

"""Early stopping: decided on rank 0 from the reduced metric, then broadcast."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from ddp_hpc.config import EarlyStoppingConfig
from ddp_hpc.errors import UserError
from ddp_hpc.training.callbacks import Callback, TrainerView, Verdict

#: The lines users read in job logs keep the source name they always had.
log = logging.getLogger("ddp_hpc.training.trainer")


@dataclass
class EarlyStoppingState:
    best: float | None = None
    best_epoch: int = -1
    bad_validations: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def update(state: EarlyStoppingState, config: EarlyStoppingConfig, value: float, epoch: int) -> Verdict:
    """Record one validation result; ``stop`` once ``patience`` results failed to improve."""
    if state.best is None:
        improved = True
    elif config.mode == "min":
        improved = value < state.best - config.min_delta
    else:
        improved = value > state.best + config.min_delta
    if improved:
        state.best, state.best_epoch, state.bad_validations = value, epoch, 0
    else:
        state.bad_validations += 1
    stop = config.patience is not None and state.bad_validations >= config.patience
    return Verdict(improved, stop)


class EarlyStopping(Callback):
    """``validation.early_stopping``: the best validation so far (``best.pt`` follows it)
    and a stop once ``patience`` validations failed to improve. Kept in checkpoints."""

    state_key = "early_stopping"

    def __init__(self, config: EarlyStoppingConfig) -> None:
        self.config = config
        self.state = EarlyStoppingState()

    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict()

    def load_state_dict(self, value: dict[str, Any]) -> None:
        self.state = EarlyStoppingState(**value)

    def best(self) -> dict[str, Any] | None:
        """For the run's summary: the best epoch and its metric, or None before any validation."""
        if self.state.best is None:
            return None
        return {"epoch": self.state.best_epoch, self.config.metric: self.state.best}

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float], epoch: int) -> Verdict:
        if self.config.metric not in metrics:
            raise UserError(f"validation.early_stopping.metric {self.config.metric!r} is not reported by the "
                            f"job (it reports: {', '.join(sorted(metrics))})")
        ctx = trainer.ctx
        verdict = update(self.state, self.config, metrics[self.config.metric], epoch) if ctx.is_rank_zero else None
        verdict, self.state = ctx.broadcast_object((verdict, self.state))
        if verdict.stop and ctx.is_rank_zero:
            log.info("early stopping after epoch %d: no improvement of validation %s for %d "
                     "validations (best %.6g at epoch %d)", epoch, self.config.metric, self.state.bad_validations,
                     self.state.best, self.state.best_epoch)
        return verdict

"""Early stopping: decided on rank 0 from the reduced metric, then broadcast."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ddp_hpc.config import EarlyStoppingConfig


@dataclass
class EarlyStoppingState:
    best: float | None = None
    best_epoch: int = -1
    bad_validations: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    improved: bool
    stop: bool


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

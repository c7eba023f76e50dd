"""The Trainer's side of ``ddp_hpc.tracking``: trackers, progress lines, the run record.

Tracking never imports ``training/``; this callback hands it what it reads (the running
sums, the metrics rows) and keeps its state (run ids, recent points) in checkpoints, so
that a resumed run continues the same tracker runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ddp_hpc.tracking import RunShape, Tracking
from ddp_hpc.training.callbacks import Callback, TrainerView
from ddp_hpc.training.metrics import MetricSums

log = logging.getLogger(__name__)


class TrackingService(Callback):
    """``epoch_sums``: the loop's running sums of the epoch in progress (tracked at each step)."""

    state_key = "tracking"

    def __init__(self, tracking: Tracking, epoch_sums: Callable[[], MetricSums]) -> None:
        self.tracking = tracking
        self.epoch_sums = epoch_sums
        #: What the checkpoint resumed from held (None: a fresh start).
        self.saved: Mapping[str, Any] | None = None
        self._step = 0

    def state_dict(self) -> dict[str, Any]:
        return self.tracking.state(self._step)

    def load_state_dict(self, value: Mapping[str, Any]) -> None:
        self.saved = value

    def on_fit_start(self, trainer: TrainerView) -> None:
        if trainer.joining:
            # Starting gathers every rank's facts, and the survivors started long ago. A
            # replacement of rank 0 trains on without trackers (docs/reliability.md).
            if trainer.ctx.is_rank_zero:
                log.warning("in-job recovery: this replacement of rank 0 does not continue the trackers "
                            "(%s); metrics.jsonl and the summary go on", ", ".join(trainer.config.logging.trackers)
                            or "none configured")
            return
        state = trainer.state
        self._step = trainer.progress.global_step
        self.tracking.start(RunShape(trainer.ctx.world_size, trainer.effective_batch_size, trainer.training.epochs,
                                     state.steps_per_epoch, state.total_steps),
                            self._step, self.saved, state.history)

    def on_step_end(self, trainer: TrainerView) -> None:
        self._step = trainer.progress.global_step
        self.tracking.on_step(trainer.progress.epoch, self._step, self.epoch_sums(),
                              trainer.optimizer.param_groups[0]["lr"])

    def on_epoch_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        self.tracking.on_epoch(metrics)

    def on_test_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self.tracking.on_test(trainer.progress.global_step, metrics)

    def on_stopped(self, trainer: TrainerView) -> None:
        self.tracking.finish(completed=False)

    def on_fit_end(self, trainer: TrainerView, summary) -> None:
        self.tracking.finish(completed=True)

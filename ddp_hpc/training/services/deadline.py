"""Stop before the job's walltime with no signal: measure, predict, and stop in time.

The ranks agree on a stop only every ``checkpoint.preemption_check_every_n_steps`` steps
(one tiny all-reduce). At each such step rank 0 asks: if training goes on, is there time
for the next interval (and the epoch end's validation and checkpoint, when the interval
crosses one), then the stop's own checkpoint, with the margin to spare? If not, it
requests the stop now, through the same agreement a SIGUSR2 uses: every rank checkpoints
at this step and the job exits with ``ExitStatus.REQUEUE``, to be requeued or continued by
the next job of a chain.

Only rank 0 decides: it writes the checkpoints, so only it knows their cost, and the other
ranks' step times include waiting for those writes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ddp_hpc.contract import DEADLINE_VAR
from ddp_hpc.engine.deadline import DeadlinePolicy, StepClock, Timings, must_stop_now, time_needed
from ddp_hpc.training.callbacks import Callback

if TYPE_CHECKING:
    from ddp_hpc.training.trainer import Trainer

log = logging.getLogger(__name__)


class DeadlineStop(Callback):
    """Requests the trainer's agreed stop when the job's deadline would come too soon.

    ``clock`` is ``time.time`` (the deadline is wall-clock time); tests pass their own.
    """

    def __init__(self, policy: DeadlinePolicy, clock: Callable[[], float] = time.time) -> None:
        self.policy, self.clock = policy, clock
        self.measured = StepClock(policy.window)
        self.stopped_at: int | None = None

    @property
    def checkpoint_s(self) -> float:
        return self.measured.checkpoint_s

    @property
    def epoch_end_s(self) -> float:
        return self.measured.epoch_end_s

    def timings(self) -> Timings:
        return self.measured.timings()

    def on_fit_start(self, trainer: Trainer) -> None:
        now = self.clock()
        self.measured.start(now)
        if trainer.ctx.is_rank_zero and self.policy.deadline <= now:
            log.warning("the job's deadline passed %.0f s ago (a stale %s?): training will "
                        "checkpoint and stop at step %d", now - self.policy.deadline, DEADLINE_VAR,
                        (trainer.progress.global_step // self.policy.check_every_n_steps + 1)
                        * self.policy.check_every_n_steps)
        elif trainer.ctx.is_rank_zero:
            log.info("job deadline in %.0f s (%s): will checkpoint and stop ahead of it (%s)",
                     self.policy.deadline - now, time.strftime("%Y-%m-%d %H:%M:%S %Z",
                                                               time.localtime(self.policy.deadline)),
                     self.policy.describe_margin())

    def on_checkpoint_saved(self, trainer: Trainer, path) -> None:
        self.measured.checkpoint_written(trainer.last_checkpoint_s)

    def on_epoch_end(self, trainer: Trainer, metrics) -> None:
        self.measured.epoch_ended(self.clock())

    def on_step_end(self, trainer: Trainer) -> None:
        now = self.clock()
        self.measured.step_ended(now)
        every = self.policy.check_every_n_steps
        step = trainer.progress.global_step
        if not trainer.ctx.is_rank_zero or step % every or trainer.stop_requested:
            return
        steps_left_in_epoch = math.ceil((trainer.plan.batches - trainer.progress.batches_done)
                                        / trainer.training.grad_accum_steps)
        timings = self.timings()
        if must_stop_now(self.policy, now, timings, every, steps_left_in_epoch <= every):
            needed = time_needed(self.policy, timings, every, steps_left_in_epoch <= every)
            log.warning("job deadline in %.1f s, but going on to step %d and stopping there needs about %.1f s "
                        "(steps of up to %.2f s, checkpoint %.1f s, epoch end %.1f s, margin %.0f s): "
                        "checkpointing and stopping at step %d", self.policy.deadline - now, step + every, needed,
                        timings.step_s, timings.checkpoint_s, timings.epoch_end_s, self.policy.margin(timings), step)
            self.stopped_at = step
            trainer.request_stop()

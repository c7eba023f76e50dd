"""A stop every rank agrees on: after a signal, or ahead of the job's deadline.

    stop = StopAgreement(checkpointer)     # the deadline from $DDP_HPC_DEADLINE, if set
    stop.handle_signals()                  # optional: SIGUSR2/SIGTERM set the flag
    ...                                    # after each step, on every rank:
    if stop.now(): break                   # True on every rank at the same step, checkpoint saved
    ...
    sys.exit(stop.exit_status)             # 75 (requeue) after a stop, else 0

A signal lands on one rank (or some); ``now`` all-reduces the flag every
``check_every_n_steps`` steps, so all ranks stop at the same step. Rank 0 also requests
the stop when the time left before the deadline gets shorter than the next interval's
steps plus a checkpoint plus ``margin_s`` (measured as training goes:
``ddp_hpc.engine.deadline``; ``auto``: the slowest step plus the slowest checkpoint, at
least 10 s). The library installs no signal handler unless
``handle_signals`` is called.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Literal

from ddp_hpc.engine.checkpointer import Checkpointer
from ddp_hpc.engine.deadline import DeadlinePolicy, StepClock, must_stop_now
from ddp_hpc.engine.group import Collectives, ProcessGroupView
from ddp_hpc.contract import ExitStatus
from ddp_hpc.stop import ALWAYS_STOP, StopSignalsOutsideTraining, job_deadline

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = ALWAYS_STOP


class StopAgreement:
    """Whether to checkpoint and stop now, answered alike on every rank."""

    def __init__(self, checkpointer: Checkpointer | None = None, *, check_every_n_steps: int = 1,
                 deadline: float | None | Literal["env"] = "env", margin_s: float | Literal["auto"] = "auto",
                 group: Collectives | None = None, clock: Callable[[], float] = time.time) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"StopAgreement: check_every_n_steps={check_every_n_steps} must be >= 1")
        if margin_s != "auto" and (isinstance(margin_s, bool) or not isinstance(margin_s, (int, float))
                                   or margin_s < 0):
            raise ValueError(f"StopAgreement: margin_s={margin_s!r} must be 'auto' or seconds >= 0")
        self.checkpointer = checkpointer
        self.check_every_n_steps = check_every_n_steps
        self.group: Collectives = group or (checkpointer.group if checkpointer else ProcessGroupView.current())
        self.clock = clock
        deadline = job_deadline(os.environ) if deadline == "env" else deadline
        self.policy = DeadlinePolicy(deadline, check_every_n_steps, margin_s) if deadline is not None else None
        self.measured = StepClock(self.policy.window if self.policy else 20)
        #: Set by a signal handler (or by hand) on any rank: stop at the next agreed step.
        self.requested = False
        #: True once the ranks agreed to stop.
        self.stopped = False
        self._steps = 0
        self._previous_handlers: dict[int, object] = {}
        self._last_save_s = 0.0
        self._by_deadline = False
        if self.policy is not None and self.group.is_rank_zero:
            log.info("job deadline in %.0f s: will checkpoint and stop ahead of it (%s)",
                     self.policy.deadline - clock(), self.policy.describe_margin())

    @property
    def exit_status(self) -> ExitStatus:
        """75 (EX_TEMPFAIL: requeue me, as rendered scripts and submitit read it) after a stop, else 0."""
        return ExitStatus.REQUEUE if self.stopped else ExitStatus.OK

    def request(self) -> None:
        """Stop at the next agreed step (safe to call from a signal handler: sets a flag)."""
        self.requested = True

    def handle_signals(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        """Install handlers that call ``request`` for ``signals`` (your choice to make:
        the library never installs one by itself). ``restore_signals`` puts the old ones back.
        A signal that ``ddp_hpc.record_stop_signals()`` recorded since the script began is
        requested now."""
        def handler(signum: int, frame: object) -> None:
            self.requested = True

        for signum in signals:
            previous = signal.signal(signum, handler)
            self._previous_handlers.setdefault(int(signum), previous)
            recorder = getattr(previous, "__self__", None)  # ddp_hpc.record_stop_signals()'s, if it ran
            if isinstance(recorder, StopSignalsOutsideTraining) and int(signum) in recorder.received:
                log.warning("%s received before the loop could act on it: stopping at the first agreed step",
                            signal.Signals(signum).name)
                self.requested = True

    def restore_signals(self) -> None:
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        self._previous_handlers.clear()

    def _step(self) -> int:
        return self.checkpointer.step if self.checkpointer is not None else self._steps

    def _deadline_near(self, now: float) -> bool:
        if self.policy is None or not self.group.is_rank_zero:
            return False
        return must_stop_now(self.policy, now, self.measured.timings(), self.check_every_n_steps, False)

    def agreed(self, step: int) -> bool:
        """Whether the ranks stop at ``step`` (every rank calls it at every step): at every
        ``check_every_n_steps``-th step one all-reduce of the flags, rank 0's deadline
        prediction included. ``now`` is this plus the measuring and the checkpoint."""
        if step % self.check_every_n_steps:
            return False
        now = self.clock()
        deadline_near = self._deadline_near(now)
        if deadline_near and not self.requested:
            log.warning("job deadline in %.1f s: checkpointing and stopping at step %d",
                        self.policy.deadline - now, step)
        wanted = self.requested or deadline_near
        self._by_deadline = deadline_near  # rank 0's own prediction: what its stop line names
        if self.group.group_initialized:
            wanted = self.group.all_reduce([1.0 if wanted else 0.0], op="max")[0] > 0
        self.stopped = self.stopped or wanted
        return wanted

    def now(self) -> bool:
        """Call after every step on every rank. True (on every rank at the same step) when
        the ranks are to stop; the checkpointer's checkpoint of this step is then on disk."""
        self._steps += 1
        if self.checkpointer is not None and self.checkpointer.last_save_s != self._last_save_s:
            self._last_save_s = self.checkpointer.last_save_s
            self.measured.checkpoint_written(self._last_save_s)
        self.measured.step_ended(self.clock())
        if not self.agreed(self._step()):
            return False
        if self.checkpointer is not None:
            self.checkpointer.save(wait=True)  # no rank exits before the checkpoint is whole on disk
        if self.group.is_rank_zero:
            log.warning("stopped %s at step %d%s: rerun or requeue to resume",
                        "ahead of the job deadline" if self._by_deadline else "on request", self._step(),
                        " with a checkpoint" if self.checkpointer is not None else "")
        return True

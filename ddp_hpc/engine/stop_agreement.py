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
steps (plus an epoch end's work, when the loop says the interval crosses one) plus a
checkpoint plus ``margin_s`` (measured as training goes: ``ddp_hpc.engine.deadline``;
``auto``: the slowest step plus the slowest checkpoint, at least 10 s). This is the one
deadline stop: the Trainer's is this one too. The library installs no signal handler
unless ``handle_signals`` is called.

After a stop, rank 0 leaves the marker ``$DDP_HPC_RUN_FOLDER/preempted`` where a rendered
batch script set that variable: under ``srun --kill-on-bad-exit`` or torchrun the ranks'
75 reaches the script as another status, and the marker tells it the ranks stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
from ddp_hpc.contract import DEADLINE_VAR, PREEMPTED_MARKER, RUN_FOLDER_VAR, ExitStatus, mark_stopped
from ddp_hpc.engine.deadline import DeadlinePolicy, StepClock, must_stop_now, time_needed
from ddp_hpc.engine.group import Collectives, ProcessGroupView
from ddp_hpc.stop import ALWAYS_STOP, job_deadline
from ddp_hpc.stop_handler import Listening, rank_stop_handler

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = ALWAYS_STOP


class StopAgreement:
    """Whether to checkpoint and stop now, answered alike on every rank."""

    def __init__(self, checkpointer: Checkpointer | None = None, *, check_every_n_steps: int = 1,
                 deadline: float | None | Literal["env"] = "env", margin_s: float | Literal["auto"] = "auto",
                 group: Collectives | None = None, clock: Callable[[], float] = time.time,
                 marker: str | os.PathLike[str] | None | Literal["env"] = "env") -> None:
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
        if marker == "env":
            folder = os.environ.get(RUN_FOLDER_VAR)
            marker = Path(folder) / PREEMPTED_MARKER if folder else None
        #: Written by rank 0 after a stop (``$DDP_HPC_RUN_FOLDER/preempted`` by default), for a
        #: batch script that sees the ranks' 75 as another status.
        self.marker = Path(marker) if marker is not None else None
        self.measured = StepClock(self.policy.window if self.policy else 20)
        #: Set by a signal handler (or by hand) on any rank: stop at the next agreed step.
        self.requested = False
        #: True once the ranks agreed to stop.
        self.stopped = False
        #: The step the ranks agreed to stop at (None: not stopped).
        self.stopped_at: int | None = None
        self._steps = 0
        self._listening: Listening | None = None
        self._last_save_s = 0.0
        self._by_deadline = False
        if self.policy is not None and self.group.is_rank_zero:
            self._announce(clock())

    def _announce(self, now: float) -> None:
        policy = self.policy
        if policy.deadline <= now:
            log.warning("the job's deadline passed %.0f s ago (a stale %s?): training will checkpoint and stop "
                        "at its first agreement step (every %d steps)", now - policy.deadline, DEADLINE_VAR,
                        self.check_every_n_steps)
        else:
            log.info("job deadline in %.0f s (%s): will checkpoint and stop ahead of it (%s)", policy.deadline - now,
                     time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(policy.deadline)),
                     policy.describe_margin())

    @property
    def reason(self) -> str:
        """Why the ranks stopped, as the stop lines say it: "ahead of the job deadline" (rank
        0 predicted the deadline) or "on request" (a signal or ``request()`` on any rank)."""
        return "ahead of the job deadline" if self._by_deadline else "on request"

    @property
    def exit_status(self) -> ExitStatus:
        """75 (EX_TEMPFAIL: requeue me, as rendered scripts and submitit read it) after a stop, else 0."""
        return ExitStatus.REQUEUE if self.stopped else ExitStatus.OK

    def request(self) -> None:
        """Stop at the next agreed step (safe to call from a signal handler: sets a flag)."""
        self.requested = True

    def handle_signals(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        """Have the rank's stop-signal handler (``ddp_hpc.stop_handler``) call ``request``
        for ``signals`` (your choice to make: the library never installs one by itself).
        ``restore_signals`` puts the old ones back. A signal that
        ``ddp_hpc.record_stop_signals()`` recorded since the script began is requested now."""
        def on_stop(signum: int, early: bool) -> None:
            self.requested = True
            if early:
                log.warning("%s received before the loop could act on it: stopping at the first agreed step",
                            signal.Signals(signum).name)

        self._listening = rank_stop_handler().listen(on_stop, signals)

    def restore_signals(self) -> None:
        if self._listening is not None:
            rank_stop_handler().stop_listening(self._listening)
            self._listening = None

    def _step(self) -> int:
        return self.checkpointer.step if self.checkpointer is not None else self._steps

    def _deadline_near(self, step: int, now: float, steps_left_in_epoch: int | None) -> bool:
        """Rank 0: whether going on to the next agreement step would leave too little time."""
        if self.policy is None or not self.group.is_rank_zero or self.requested:
            return False
        every, timings = self.check_every_n_steps, self.measured.timings()
        crosses = steps_left_in_epoch is not None and steps_left_in_epoch <= every
        if not must_stop_now(self.policy, now, timings, every, crosses):
            return False
        log.warning("job deadline in %.1f s, but going on to step %d and stopping there needs about %.1f s "
                    "(steps of up to %.2f s, checkpoint %.1f s, epoch end %.1f s, margin %.0f s): "
                    "checkpointing and stopping at step %d", self.policy.deadline - now, step + every,
                    time_needed(self.policy, timings, every, crosses), timings.step_s, timings.checkpoint_s,
                    timings.epoch_end_s, self.policy.margin(timings), step)
        return True

    def agreed(self, step: int, *, steps_left_in_epoch: int | None = None, now: float | None = None) -> bool:
        """Whether the ranks stop at ``step`` (every rank calls it at every step): at every
        ``check_every_n_steps``-th step one all-reduce of the flags, rank 0's deadline
        prediction included (``steps_left_in_epoch``: the interval may cross an epoch end,
        whose work it then counts). ``now`` is this plus the measuring and the checkpoint."""
        if step % self.check_every_n_steps:
            return False
        now = self.clock() if now is None else now
        deadline_near = self._deadline_near(step, now, steps_left_in_epoch)
        wanted = self.requested or deadline_near
        self._by_deadline = deadline_near  # rank 0's own prediction: what its stop line names
        if self.group.group_initialized:
            wanted = self.group.all_reduce([1.0 if wanted else 0.0], op="max")[0] > 0
        if wanted and not self.stopped:
            self.stopped, self.stopped_at = True, step
        return wanted

    def start(self) -> None:
        """Training starts now: the deadline's measuring counts the first step from here
        (without it, from the end of the first step on)."""
        self.measured.start(self.clock())

    def continue_at(self, step: int) -> None:
        """In-job recovery: the ranks (a replacement among them) go on after ``step``; the
        steps are counted from there and the recovery's seconds measured as no step's."""
        self._steps = step
        self.start()

    def _measure_checkpoint(self) -> None:
        if self.checkpointer is not None and self.checkpointer.last_save_s != self._last_save_s:
            self._last_save_s = self.checkpointer.last_save_s
            self.measured.checkpoint_written(self._last_save_s)

    def epoch_ended(self) -> None:
        """After an epoch's end work (validation, its checkpoint): measured, so the deadline
        leaves time for the next one."""
        self._measure_checkpoint()
        self.measured.epoch_ended(self.clock())

    def now(self, *, steps_left_in_epoch: int | None = None, quiet: bool = False) -> bool:
        """Call after every step on every rank. True (on every rank at the same step) when
        the ranks are to stop; the checkpointer's checkpoint of this step is then on disk
        (at an epoch's last step: once ``checkpointer.epoch_done`` saved it).
        ``steps_left_in_epoch``: optimizer steps left in the epoch, for the deadline's
        prediction. ``quiet``: no "stopped" line (the caller logs its own)."""
        self._steps += 1
        self._measure_checkpoint()
        now = self.clock()
        self.measured.step_ended(now)
        if not self.agreed(self._step(), steps_left_in_epoch=steps_left_in_epoch, now=now):
            return False
        if self.checkpointer is not None:
            self.checkpointer.save_step(wait=True)  # no rank exits before the checkpoint is whole on disk
        if self.group.is_rank_zero and self.marker is not None:
            mark_stopped(self.marker)
        if self.group.is_rank_zero and not quiet:
            log.warning("stopped %s at step %d%s: rerun or requeue to resume", self.reason, self._step(),
                        " with a checkpoint" if self.checkpointer is not None else "")
        return True

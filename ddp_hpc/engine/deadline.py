"""The walltime arithmetic: given what a step and a checkpoint cost, must training stop now?

The ranks agree on a stop only every ``check_every_n_steps`` steps (one tiny all-reduce).
At each such step rank 0 asks: if training goes on, is there time for the next interval
(and the epoch end's validation and checkpoint, when the interval crosses one), then the
stop's own checkpoint, with the margin to spare? If not, it requests the stop now,
through the same agreement a signal uses. Only rank 0 decides: it writes the
checkpoints, so only it knows their cost, and the other ranks' step times include
waiting for those writes. Used by ``StopAgreement``, the one deadline stop (a loop of
one's own and the Trainer alike).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

#: The least margin ``auto`` keeps: process exit, launcher teardown, clocks of different nodes.
MARGIN_FLOOR_S = 10.0


@dataclass(frozen=True)
class DeadlinePolicy:
    """When to stop ahead of a known end time."""

    #: The job's end, in seconds since the epoch (``time.time()``).
    deadline: float
    #: Steps between two chances to stop (``checkpoint.preemption_check_every_n_steps``).
    check_every_n_steps: int
    #: Kept free besides the predicted work: process exit, launcher teardown, clocks of
    #: different nodes, a step or a checkpoint slower than measured. ``auto``: the measured
    #: slowest step plus the slowest checkpoint, and at least ``MARGIN_FLOOR_S``.
    margin_s: float | Literal["auto"] = "auto"
    #: Step times remembered; the slowest of them is the prediction.
    window: int = 20

    def margin(self, timings: Timings) -> float:
        """The margin in seconds, given what was measured so far."""
        if self.margin_s == "auto":
            return max(MARGIN_FLOOR_S, timings.step_s + timings.checkpoint_s)
        return float(self.margin_s)

    def describe_margin(self) -> str:
        """For log lines: ``margin 60 s`` or ``margin auto, at least 10 s``."""
        if self.margin_s == "auto":
            return f"margin auto, at least {MARGIN_FLOOR_S:.0f} s"
        return f"margin {float(self.margin_s):.0f} s"


@dataclass(frozen=True)
class Timings:
    """What rank 0 measured so far (seconds); 0 until measured."""

    step_s: float = 0.0
    checkpoint_s: float = 0.0
    epoch_end_s: float = 0.0


def time_needed(policy: DeadlinePolicy, timings: Timings, steps_to_next_check: int, crosses_epoch_end: bool) -> float:
    """Seconds that going on to the next check and stopping there would take."""
    epoch_end = timings.epoch_end_s + timings.checkpoint_s if crosses_epoch_end else 0.0
    return steps_to_next_check * timings.step_s + epoch_end + timings.checkpoint_s + policy.margin(timings)


def must_stop_now(policy: DeadlinePolicy, now: float, timings: Timings, steps_to_next_check: int,
                  crosses_epoch_end: bool) -> bool:
    return policy.deadline - now < time_needed(policy, timings, steps_to_next_check, crosses_epoch_end)


class StepClock:
    """Rank 0's measurements for the prediction: the slowest recent steps, the slowest
    checkpoint and epoch end. A checkpoint written during a step is measured on its own,
    not as step time."""

    def __init__(self, window: int) -> None:
        self.steps: deque[float] = deque(maxlen=window)
        self.checkpoint_s = 0.0
        self.epoch_end_s = 0.0
        self._mark: float | None = None
        self._saved_since_mark = 0.0

    def timings(self) -> Timings:
        return Timings(max(self.steps, default=0.0), self.checkpoint_s, self.epoch_end_s)

    def _since_mark(self, now: float) -> float | None:
        if self._mark is None:
            return None
        return max(0.0, now - self._mark - self._saved_since_mark)

    def start(self, now: float) -> None:
        self._mark, self._saved_since_mark = now, 0.0

    def checkpoint_written(self, seconds: float) -> None:
        self.checkpoint_s = max(self.checkpoint_s, seconds)
        self._saved_since_mark += seconds

    def step_ended(self, now: float) -> None:
        elapsed = self._since_mark(now)
        if elapsed is not None:
            self.steps.append(elapsed)
        self.start(now)

    def epoch_ended(self, now: float) -> None:
        elapsed = self._since_mark(now)
        if elapsed is not None:
            self.epoch_end_s = max(self.epoch_end_s, elapsed)
        self.start(now)

"""The one interface every experiment tracker implements, and the values it is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TrackerStart:
    """What a tracker needs to start or continue its run (rank 0 only)."""

    run_name: str
    #: ``runs/<name>/tracking``: every tracker keeps its local files under it.
    folder: Path
    #: The tracker's run id from the checkpoint (None: a new run).
    run_id: str | None
    #: The global step of the checkpoint training resumes from (0 on a fresh start).
    resume_step: int
    #: Flattened hyperparameters: the resolved config plus world size and effective batch.
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Held:
    """The points a tracker already holds from an earlier attempt of the same run.

    ``upto``: every metric's points up to this step; ``per_key``: a metric's own last
    step where the tracker knows it. A point the tracker holds is not sent again.
    """

    upto: int = -1
    per_key: dict[str, int] = field(default_factory=dict)

    def holds(self, key: str, step: int) -> bool:
        return step <= max(self.upto, self.per_key.get(key, -1))


class Tracker:
    """An experiment tracker on rank 0. Methods may raise; the caller turns that into a
    warning and goes on without the tracker."""

    name = "tracker"

    def start(self, start: TrackerStart) -> tuple[str, Held]:
        """Start (``start.run_id`` None) or continue the run: (its run id, what it holds)."""
        raise NotImplementedError

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make everything logged so far durable (before a checkpoint is written)."""

    def close(self, finished: bool) -> None:
        """End this attempt; ``finished``: the run is complete (not preempted)."""

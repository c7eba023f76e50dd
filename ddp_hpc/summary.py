"""The result of a training run: one typed value, written as ``summary.json`` and read back
by ``submit --wait`` and ``ddp-hpc status``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from ddp_hpc.contract import CHECKPOINTS_DIR, ExitStatus

SCHEMA_VERSION = 1


class RunStatus(str, Enum):
    COMPLETED = "completed"
    EARLY_STOPPED = "early_stopped"
    #: Stopped on request (signal, deadline) after a checkpoint; a rerun resumes it.
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class RunSummary:
    status: RunStatus
    run_dir: str
    job: str
    epochs_completed: int
    global_step: int
    world_size: int
    backend: str = ""
    device: str = ""
    effective_batch_size: int = 0
    samples_per_s: float | None = None
    wall_time_s: float = 0.0
    #: The last epoch's metrics row (train_*, val_*, lr, ...).
    final: dict[str, Any] = field(default_factory=dict)
    #: ``{"epoch": N, METRIC: value}`` for the best validation, when early stopping watches one.
    best: dict[str, Any] | None = None
    test: dict[str, float] | None = None
    epochs_run_per_rank: list[int] = field(default_factory=list)
    parameter_checksums_per_rank: list[float] = field(default_factory=list)
    #: Bytes of parameters plus optimizer state each rank holds (a shard of them under fsdp2).
    state_bytes_per_rank: list[int] = field(default_factory=list)
    #: For a preempted run: the signal this rank received (``SIGUSR2``), or None (the
    #: job's deadline, or another rank's signal).
    stopped_by: str | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def preempted(self) -> bool:
        return self.status is RunStatus.PREEMPTED

    @property
    def exit_status(self) -> ExitStatus:
        """What a process that ran this rank exits with: ``ExitStatus.REQUEUE`` after a
        stop on request, so that a requeue or the next link of a chain resumes the run."""
        return ExitStatus.REQUEUE if self.preempted else ExitStatus.OK

    def stop_line(self) -> str:
        """One line for a run stopped on request: where it stopped and how it goes on."""
        return (f"stopped at step {self.global_step} on request; the checkpoint is in "
                f"{Path(self.run_dir) / CHECKPOINTS_DIR}: rerun or requeue to resume")

    @property
    def stopped_early(self) -> bool:
        return self.status is RunStatus.EARLY_STOPPED

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["stopped_early"] = self.stopped_early
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["status"] = RunStatus(values.get("status", RunStatus.COMPLETED.value))
        return cls(**values)

    @classmethod
    def read(cls, path: Path) -> RunSummary:
        return cls.from_dict(json.loads(path.read_text()))

    def headline(self) -> str:
        """One line for people: epochs, steps, world size, speed and test metrics."""
        test = "".join(f", test {k} {v:.4f}" for k, v in sorted((self.test or {}).items()))
        rate = f", {self.samples_per_s:.0f} samples/s" if self.samples_per_s else ""
        return (f"{self.epochs_completed} epochs, {self.global_step} steps, world size "
                f"{self.world_size}{rate}, {self.wall_time_s:.1f}s{test}")

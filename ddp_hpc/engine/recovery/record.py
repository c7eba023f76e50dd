"""Each in-job recovery in the run record (``record/recovery-<generation>.json``): written by
rank 0 of the new group, read by the goodput benchmark. Torch-free, so readers need no torch."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from ddp_hpc.contract import RECORD_DIR, atomic_write

FILE_GLOB = "recovery-*.json"
E = TypeVar("E")


@dataclass(frozen=True)
class RecoveryEvent:
    """One recovery, as the run record keeps it."""

    generation: int
    #: The lost rank's slot (its rank in the first group), host and why it was lost.
    rank: int
    host: str
    cause: str
    replaced: bool
    world_size: int
    #: The step every rank continued from: the last step every survivor completed (counted
    #: by ``step_done``, from 1); the step the loss broke, step + 1, is done again.
    step: int
    #: ``time.time()`` when the launch saw the loss.
    detected_at: float
    #: Seconds from the launch seeing the loss to: the new group formed on this rank, the
    #: state received, the first step after it completed (the time to recover).
    group_s: float
    transfer_s: float
    recover_s: float
    #: After a shrink: samples of the rest of the epoch that the new group trains twice,
    #: because the rest does not divide over its ranks (the sampler's padding; 0 otherwise).
    repeated_samples: int = 0
    #: A sharded model (snapshots): the snapshot step every rank went back to (= ``step``),
    #: the steps done again from the newest one a member had completed, and the slots whose
    #: shards came from a buddy's copy.
    snapshot_step: int | None = None
    redone_steps: int = 0
    from_buddies: tuple[int, ...] = ()


def _write(run_dir: Path, name: str, event: Any) -> Path:
    """``record/<name>`` in ``run_dir``: ``event`` and the host that wrote it, atomically."""
    path = run_dir / RECORD_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({**asdict(event), "recorded_by": socket.gethostname()}, indent=1) + "\n")
    return path


def _read(run_dir: Path, pattern: str, kind: type[E]) -> list[E]:
    """Every ``kind`` recorded under ``record/<pattern>`` (fields it lacks at their default)."""
    names = {field.name for field in fields(kind)}
    events = []
    for path in (run_dir / RECORD_DIR).glob(pattern):
        raw = json.loads(path.read_text())
        raw["from_buddies"] = tuple(raw.get("from_buddies", ()))
        events.append(kind(**{name: value for name, value in raw.items() if name in names}))
    return events


def write_recovery(run_dir: Path, event: RecoveryEvent) -> Path:
    """``record/recovery-<generation>.json`` in ``run_dir``, written atomically."""
    return _write(run_dir, f"recovery-{event.generation}.json", event)


def read_recoveries(run_dir: Path) -> list[RecoveryEvent]:
    """Every recovery recorded in ``run_dir``, by generation."""
    return sorted(_read(run_dir, FILE_GLOB, RecoveryEvent), key=lambda event: event.generation)


RESUME_GLOB = "resume-*.json"


@dataclass(frozen=True)
class ResumeEvent:
    """Where a restart in place of a sharded model under ``--recover`` took its state from."""

    #: The restart (``DDP_HPC_RESTART_COUNT``).
    restart: int
    #: ``memory`` (the snapshots the nodes kept) or ``disk`` (the newest checkpoint).
    tier: str
    #: The step training continued from, and the step of the checkpoint the loop restored.
    step: int
    checkpoint_step: int
    #: Slots whose snapshot came from another rank's node (a buddy's copy).
    from_buddies: tuple[int, ...] = ()


def write_resume(run_dir: Path, event: ResumeEvent) -> Path:
    """``record/resume-<restart>.json`` in ``run_dir``, written atomically."""
    return _write(run_dir, f"resume-{event.restart}.json", event)


def read_resumes(run_dir: Path) -> list[ResumeEvent]:
    """Every restart in place recorded in ``run_dir``, in order."""
    return sorted(_read(run_dir, RESUME_GLOB, ResumeEvent), key=lambda event: event.restart)


@dataclass(frozen=True)
class SnapshotPlan:
    """How a sharded model's snapshots are kept (``record/snapshots.json``, by rank 0 at the
    start of each attempt under ``--recover``)."""

    every: int
    replicas: int
    distance: int
    kept_steps: int
    folder: str
    #: Node-local memory each rank's snapshots take (its own and the copies it holds, every
    #: kept step, and its host buffers), by rank.
    bytes_per_rank: dict[str, int]


def write_snapshot_plan(run_dir: Path, plan: SnapshotPlan) -> Path:
    path = run_dir / RECORD_DIR / "snapshots.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(asdict(plan), indent=1) + "\n")
    return path

"""Each in-job recovery in the run record: one file per lost rank, written by rank 0 of the
group that trained again after it, read by the goodput benchmark. Torch-free, so readers
need no torch.

The file is ``record/recovery-<generation>.json``: ``<generation>`` is the launch's plan of
that loss, counted from 1 in each attempt (the Nth rank lost in it, whichever way: two ranks
lost at once are two plans, 1 and 2, and two files; so is a replacement that dies before its
group trained, with ``replacement`` true). After a restart in place (``$DDP_HPC_RESTART_COUNT``
> 0) the attempt's files are ``recovery-<restart>-<generation>.json``, so that none of an
earlier attempt is overwritten."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field, fields
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
    #: The lost process was a replacement (or the warm spare) put in the slot after an earlier loss.
    replacement: bool = False
    #: The generation of the group that trained again after this loss: its own, or a later
    #: one where more ranks were lost before any step was completed (two lost at once).
    recovered_in: int | None = None
    #: The restart in place the attempt was (``$DDP_HPC_RESTART_COUNT``; 0: the first attempt).
    restart: int = 0


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


def recovery_file(event: RecoveryEvent) -> str:
    """The record's file name (see the module's docstring)."""
    if event.restart:
        return f"recovery-{event.restart}-{event.generation}.json"
    return f"recovery-{event.generation}.json"


def write_recovery(run_dir: Path, event: RecoveryEvent) -> Path:
    """``record/<recovery_file(event)>`` in ``run_dir``, written atomically."""
    return _write(run_dir, recovery_file(event), event)


def read_recoveries(run_dir: Path) -> list[RecoveryEvent]:
    """Every recovery recorded in ``run_dir``, by attempt and generation."""
    return sorted(_read(run_dir, FILE_GLOB, RecoveryEvent), key=lambda event: (event.restart, event.generation))


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
    #: Node-local memory per rank: its host's ``node_bytes`` shared by its ranks, by rank.
    bytes_per_rank: dict[str, int]
    #: One snapshot of each rank (its shards, optimizer state and the rest, serialized), by rank.
    snapshot_bytes: dict[str, int] = field(default_factory=dict)
    #: What each host's memory holds: ``file_bytes`` and each of its ranks' host buffers (one
    #: snapshot each, in the rank's process), by host.
    node_bytes: dict[str, int] = field(default_factory=dict)
    #: The files under ``folder`` on each host: ``kept_steps`` of each slot whose copies it
    #: keeps (its ranks' own and the ones they hold; a rank and its buddy on one host share
    #: one file per slot and step), by host.
    file_bytes: dict[str, int] = field(default_factory=dict)


def write_snapshot_plan(run_dir: Path, plan: SnapshotPlan) -> Path:
    path = run_dir / RECORD_DIR / "snapshots.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(asdict(plan), indent=1) + "\n")
    return path

"""Goodput and the cost of each failure, from the ranks' own logs (``ddp-hpc bench goodput``).

Pure functions over what one arm of the harness (``bench/goodput_run.py``) collected: the
lines each rank wrote (``bench/goodput_loop.py``), the faults the harness injected, the
moments the launch reported a failed rank (its log line) and the in-job recovery records
(``record/recovery-<generation>.json``). Nothing here reads a clock or a file.

An *epoch* is one group of processes training together: ``(launch, attempt, generation)``
(a new launch for a requeue, a new attempt for a restart in place, a new generation for an
in-job recovery), ordered as tuples.

- A step *counts* when the run's state at the end contains it: steps 1 to the last step of
  the final epoch, each in the latest epoch that completed it (an earlier completion was
  redone; a step completed beyond the final epoch's position was lost, as the state went
  back to a checkpoint). Its time is the median over the ranks of that completion's
  duration (from the end of the rank's previous step to the end of this one; checkpoint
  saves excluded).
- goodput = the counted steps' time / the wall time of the arm (the launch's start to the
  harness's stop: start-up, checkpoints, failures and redone steps are the rest).
- Per fault, at ``T`` (the signal): *detect* = the launch saw it (the recovery record's
  ``detected_at``, or the launch's "exited with status" line); *re-form* = a new group
  formed (the record's ``group_s``, or the last rank's group line of the next epoch:
  processes started, torch imported, rendezvous); *transfer* = the state arrived (the
  record's ``transfer_s``, or the last rank's end of the checkpoint restore); *redo* =
  until the steps completed before ``T`` were completed again; then the first new step.
  *kill -> next step* = ``T`` to the first step every rank of the next epoch completed;
  *kill -> progress* = ``T`` to the first step beyond those completed before ``T``.
  For a sharded model's recovery (snapshots), *transfer* is the roll back: every rank loads
  the newest snapshot every shard has (its own, or a buddy's for the lost rank's); the
  record's snapshot step, its count of redone steps and ``recover_s`` are shown beside.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddp_hpc.engine.recovery.record import RecoveryEvent

Epoch = tuple[int, int, int]


@dataclass(frozen=True)
class Step:
    slot: int
    pid: int
    epoch: Epoch
    step: int
    started: float
    ended: float


@dataclass(frozen=True)
class Event:
    """``group`` (value: generation) or ``restored`` (value: the step restored) or ``start``."""

    kind: str
    slot: int
    pid: int
    epoch: Epoch
    value: int
    at: float


@dataclass(frozen=True)
class Fault:
    at: float
    slot: int
    pid: int
    kind: str  # "kill" (SIGKILL) or "hang" (SIGSTOP)


@dataclass(frozen=True)
class ArmLogs:
    """What one arm's run left: every rank's lines, the faults, the launch's detections."""

    steps: tuple[Step, ...]
    events: tuple[Event, ...]
    faults: tuple[Fault, ...]
    detections: tuple[float, ...]
    recoveries: tuple[RecoveryEvent, ...]
    started: float
    stopped: float


@dataclass(frozen=True)
class FaultCost:
    at: float
    slot: int
    kind: str
    recovered_in_job: bool
    steps_redone: int
    detect_s: float | None
    reform_s: float | None
    transfer_s: float | None
    redo_s: float | None
    kill_to_next_step_s: float | None
    kill_to_progress_s: float | None
    #: From the recovery record (None without one): the launch seeing the loss to the first
    #: step after it; and for a sharded model the snapshot step every rank rolled back to,
    #: the steps the record counts as done again, and the slots whose shards a buddy held.
    recover_s: float | None = None
    snapshot_step: int | None = None
    record_redone_steps: int | None = None
    from_buddies: tuple[int, ...] = ()


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    counted_steps: int
    completed_steps: int
    counted_s: float
    goodput: float
    faults: tuple[FaultCost, ...]
    median_kill_to_next_step_s: float | None
    median_kill_to_progress_s: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_line(slot: int, line: str) -> Step | Event | None:
    """One line of ``goodput_loop``'s log; None for a line cut short (still being written)."""
    fields = line.split()
    try:
        kind, pid, launch, attempt = fields[0], int(fields[1]), int(fields[2]), int(fields[3])
        if kind == "step" and len(fields) == 8:
            return Step(slot, pid, (launch, attempt, int(fields[4])), int(fields[5]), float(fields[6]),
                        float(fields[7]))
        if kind == "group" and len(fields) == 6:
            return Event(kind, slot, pid, (launch, attempt, int(fields[4])), int(fields[4]), float(fields[5]))
        if kind == "restored" and len(fields) == 6:
            return Event(kind, slot, pid, (launch, attempt, 0), int(fields[4]), float(fields[5]))
        if kind == "start" and len(fields) == 5:
            return Event(kind, slot, pid, (launch, attempt, 0), 0, float(fields[4]))
    except (IndexError, ValueError):
        return None
    return None


def _by_epoch_and_step(steps: Iterable[Step]) -> dict[tuple[Epoch, int], list[Step]]:
    grouped: dict[tuple[Epoch, int], list[Step]] = defaultdict(list)
    for step in steps:
        grouped[step.epoch, step.step].append(step)
    return grouped


def counted_steps(steps: Sequence[Step], stopped: float) -> dict[int, list[Step]]:
    """Each step that counts at ``stopped`` -> its completion by every rank (see the module's doc)."""
    done = [s for s in steps if s.ended <= stopped]
    if not done:
        return {}
    final = max(s.epoch for s in done)
    last = max(s.step for s in done if s.epoch == final)
    latest: dict[int, Epoch] = {}
    for s in done:
        if s.step <= last and s.epoch > latest.get(s.step, (-1, -1, -1)):
            latest[s.step] = s.epoch
    grouped = _by_epoch_and_step(done)
    return {number: grouped[epoch, number] for number, epoch in sorted(latest.items())}


def _median_duration(completions: Sequence[Step]) -> float:
    return statistics.median(s.ended - s.started for s in completions)


def fault_cost(fault: Fault, until: float, logs: ArmLogs) -> FaultCost:
    """The cost of ``fault``, from the logs up to ``until`` (the next fault, or the stop)."""
    before = [s for s in logs.steps if s.ended <= fault.at]
    empty = FaultCost(fault.at, fault.slot, fault.kind, False, 0, None, None, None, None, None, None)
    if not before:
        return empty
    old = max(s.epoch for s in before)
    done_before = max(s.step for s in logs.steps if s.epoch == old)
    later = [s for s in logs.steps if s.epoch > old and s.ended <= until]
    if not later:
        return empty
    new = min(s.epoch for s in later)
    grouped = _by_epoch_and_step(later)
    first = min(s.step for s in later if s.epoch == new)
    next_step_at = max(s.ended for s in grouped[new, first])
    redone = max(0, done_before - first + 1)
    progress = [s for s in later if s.step == done_before + 1]
    progress_at = max(s.ended for s in grouped[min(s.epoch for s in progress), done_before + 1]) if progress else None

    in_job = new[:2] == old[:2] and new[2] > old[2]
    record = next((r for r in logs.recoveries if r.generation == new[2] and fault.at <= r.detected_at < until),
                  None) if in_job else None
    if record is not None:
        detect_at: float | None = record.detected_at
        group_at: float | None = record.detected_at + record.group_s
        transfer_at: float | None = record.detected_at + record.transfer_s
    else:
        detect_at = next((t for t in sorted(logs.detections) if fault.at <= t < until), None)
        groups = [e.at for e in logs.events if e.kind == "group" and e.epoch == new]
        # After the fault: an in-job recovery without its record shares the attempt of the first restore.
        restores = [e.at for e in logs.events
                    if e.kind == "restored" and e.epoch[:2] == new[:2] and e.at >= fault.at]
        group_at = max(groups) if groups else None
        transfer_at = max(restores) if restores else None
    redo_end = max(s.ended for s in grouped[new, done_before]) if redone and (new, done_before) in grouped else (
        transfer_at if not redone else None)
    return FaultCost(
        at=fault.at, slot=fault.slot, kind=fault.kind, recovered_in_job=in_job, steps_redone=redone,
        detect_s=_between(fault.at, detect_at), reform_s=_between(detect_at, group_at),
        transfer_s=_between(group_at, transfer_at), redo_s=_between(transfer_at, redo_end),
        kill_to_next_step_s=next_step_at - fault.at, kill_to_progress_s=_between(fault.at, progress_at),
        **_record_fields(record))


def _record_fields(record: RecoveryEvent | None) -> dict[str, Any]:
    if record is None:
        return {}
    sharded = record.snapshot_step is not None
    return {"recover_s": record.recover_s, "snapshot_step": record.snapshot_step,
            "record_redone_steps": record.redone_steps if sharded else None, "from_buddies": record.from_buddies}


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def goodput(logs: ArmLogs) -> Goodput:
    """Goodput and each fault's cost for one arm's run (see the module's doc)."""
    counted = counted_steps(logs.steps, logs.stopped)
    counted_s = sum(_median_duration(completions) for completions in counted.values())
    wall = logs.stopped - logs.started
    faults = sorted(logs.faults, key=lambda f: f.at)
    costs = tuple(fault_cost(f, faults[i + 1].at if i + 1 < len(faults) else logs.stopped, logs)
                  for i, f in enumerate(faults))
    to_next = [c.kill_to_next_step_s for c in costs if c.kill_to_next_step_s is not None]
    to_progress = [c.kill_to_progress_s for c in costs if c.kill_to_progress_s is not None]
    return Goodput(wall_s=wall, counted_steps=len(counted),
                   completed_steps=len({(s.epoch, s.step) for s in logs.steps if s.ended <= logs.stopped}),
                   counted_s=counted_s, goodput=counted_s / wall if wall > 0 else 0.0, faults=costs,
                   median_kill_to_next_step_s=statistics.median(to_next) if to_next else None,
                   median_kill_to_progress_s=statistics.median(to_progress) if to_progress else None)


def timeline(logs: ArmLogs) -> dict[str, list]:
    """The arm's steps over time, for its figure: each step's completion by every rank of its
    epoch (seconds from the arm's start, the step; a step redone appears again, lower than the
    one before it), and each fault (seconds, kind, rank)."""
    grouped = _by_epoch_and_step(s for s in logs.steps if s.ended <= logs.stopped)
    done = sorted((max(s.ended for s in steps) - logs.started, step) for (_, step), steps in grouped.items())
    return {"steps": [[round(at, 3), step] for at, step in done],
            "faults": [[round(f.at - logs.started, 3), f.kind, f.slot] for f in sorted(logs.faults, key=lambda f: f.at)]}

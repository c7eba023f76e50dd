"""Looking into a run's checkpoints, either format: ``ddp-hpc checkpoint inspect`` (with the
tier each restart in place resumed from) and ``ddp-hpc checkpoint convert`` (a sharded
checkpoint folder to one file for inference)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ddp_hpc.contract import CHECKPOINTS_DIR, atomic_write
from ddp_hpc.engine.checkpoint import files as files
from ddp_hpc.engine.checkpoint import dcp_read
from ddp_hpc.engine.recovery.record import ResumeEvent, read_resumes
from ddp_hpc.errors import UserError


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint of a run: where, which step, how big, whether it can be used."""

    path: str
    step: int
    format: Literal["file", "dcp"]
    size_bytes: int
    complete: bool
    #: Ranks that wrote it (None where it cannot be read).
    world_size: int | None
    #: Why it is not complete (None when it is).
    problem: str | None


def checkpoints_folder(run: str | Path) -> Path:
    """A run folder's ``checkpoints/`` (or that folder itself); a ``UserError`` otherwise."""
    path = Path(run)
    if (path / CHECKPOINTS_DIR).is_dir():
        return path / CHECKPOINTS_DIR
    if path.is_dir() and path.name == CHECKPOINTS_DIR:
        return path
    if not path.exists():
        raise UserError(f"{run} does not exist: name a run folder, e.g. runs/digits")
    raise UserError(f"{run} is not a run folder: it has no {CHECKPOINTS_DIR}/ (name a run folder, e.g. runs/digits)")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _file_info(path: Path) -> CheckpointInfo:
    step = int(path.stem.split("-")[1])
    ranks = path.with_suffix(files.RANKS_SUFFIX)
    size = _size(path) + _size(ranks)
    try:
        state = files.load_checkpoint(path)
    except files.CheckpointError as exc:
        return CheckpointInfo(str(path), step, "file", size, False, None, str(exc))
    return CheckpointInfo(str(path), step, "file", size, True, int(state.get("world_size", 1)), None)


def _dcp_info(path: Path) -> CheckpointInfo:
    step = dcp_read.step_of(path)
    size = _size(path)
    try:
        metadata = dcp_read.check_complete(path)
        shared = dcp_read.read_blob(path, metadata, dcp_read.SHARED_KEY)
    except files.CheckpointError as exc:
        return CheckpointInfo(str(path), step, "dcp", size, False, None, str(exc))
    return CheckpointInfo(str(path), step, "dcp", size, True, int(shared.get("world_size", 1)), None)


def inspect_checkpoints(run: str | Path) -> list[CheckpointInfo]:
    """Every periodic checkpoint of a run, either format, oldest first: step, size on disk,
    complete or not (and why), the world size that wrote it. Reads each one (weights-only)."""
    folder = checkpoints_folder(run)
    infos = [_file_info(p) for p in files.periodic_checkpoints(folder)]
    infos += [_dcp_info(p) for p in dcp_read.sharded_checkpoints(folder)]
    return sorted(infos, key=lambda info: (info.step, info.format))


def inspect_resumes(run: str | Path) -> list[ResumeEvent]:
    """Each restart in place of a run that took its state from the snapshots the nodes kept
    in memory or from the checkpoint on disk (``record/resume-<restart>.json``), in order."""
    return read_resumes(checkpoints_folder(run).parent)


def format_table(infos: list[CheckpointInfo], resumes: list[ResumeEvent] | None = None) -> str:
    """``inspect``'s table, one line per checkpoint, then one line per restart in place
    saying which tier it resumed from."""
    return "\n".join([_checkpoint_lines(infos), *(_resume_line(resume) for resume in resumes or ())])


def _resume_line(resume: ResumeEvent) -> str:
    if resume.tier == "memory":
        buddies = (f", the shards of rank(s) {', '.join(map(str, resume.from_buddies))} from a buddy's copy"
                   if resume.from_buddies else "")
        where = f"the snapshots in node-local memory{buddies} (the newest checkpoint: step {resume.checkpoint_step})"
    else:
        where = "the checkpoint on disk"
    return f"restart {resume.restart}: resumed at step {resume.step} from {where}"


def _checkpoint_lines(infos: list[CheckpointInfo]) -> str:
    if not infos:
        return "no checkpoints"
    lines = [f"{'step':>8}  {'format':6}  {'size':>10}  {'ranks':>5}  {'complete':8}  path"]
    for info in infos:
        ranks = str(info.world_size) if info.world_size is not None else "-"
        state = "yes" if info.complete else "NO"
        lines.append(f"{info.step:>8}  {info.format:6}  {info.size_bytes / 1e6:>7.2f} MB  {ranks:>5}  {state:8}  "
                     f"{info.path}" + (f"  ({info.problem.replace(f'checkpoint {info.path} ', '')})"
                                          if info.problem else ""))
    return "\n".join(lines)


def convert_checkpoint(run: str | Path, output: str | Path, *, step: int | None = None) -> Path:
    """Write one ``torch.save`` file from a run's sharded (dcp) checkpoint: the newest
    complete one, or ``step``'s. It holds what a single-file checkpoint holds (``model``:
    the full weights, without DDP's ``module.`` prefix; optimizer, progress, config, ...),
    loads with ``torch.load(path, weights_only=True)``, and needs no process group.
    Runs in one process and needs the memory of the whole state."""
    folder = checkpoints_folder(run)
    if step is None:
        found = dcp_read.newest_complete(folder)
        if found is None:
            raise UserError(f"{folder} holds no complete sharded (dcp) checkpoint to convert")
        source = found[0]
    else:
        source = dcp_read.step_dir(folder, step)
        if not source.is_dir():
            steps = [dcp_read.step_of(p) for p in dcp_read.sharded_checkpoints(folder)]
            raise UserError(f"{folder} has no sharded checkpoint of step {step} (it has: "
                            f"{', '.join(map(str, steps)) or 'none'})")
    state: dict[str, Any] = dcp_read.read_whole(source)
    out = Path(output)
    if out.is_dir():
        raise UserError(f"{output} is a folder: name the file to write, e.g. model.pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda handle: torch.save(state, handle), durable=True)
    return out

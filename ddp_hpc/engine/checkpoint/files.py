"""Checkpoint files: written atomically by rank 0, read back with ``weights_only=True``.

Layout in ``runs/<name>/checkpoints/``: ``step-00000120.pt`` periodic files (the newest
``keep_last`` are kept), and ``last.pt`` / ``best.pt`` as hard links to one of them (or
their own copy where the file system has no hard links). A file only ever appears
complete: it is written to a hidden temporary name, flushed, fsync'd and renamed.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_hpc.contract import BEST_CHECKPOINT, LAST_CHECKPOINT, TEMPORARY_GLOB, atomic_write, fsync_directory
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_STEP_FILE = re.compile(r"^step-(\d{8})\.pt$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used here (corrupt, other model, other world size)."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: torch.save's zip writer reports a full disk either as the
    OSError itself or as a RuntimeError ("unexpected pos") raised while closing after it."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def save_atomic(state: Mapping[str, Any], path: Path) -> Path:
    """Write ``state`` to ``path`` so that ``path`` is either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda handle: torch.save(dict(state), handle), durable=True)
    except (OSError, RuntimeError) as exc:  # a full disk or quota: the previous checkpoint is still whole
        cause = _os_error(exc)
        if cause is None:
            raise
        raise CheckpointError(f"cannot write checkpoint {path}: {cause.strerror or cause}; the previous checkpoint "
                              f"is kept: free space in {path.parent} and rerun to resume") from None
    return path


def link_atomic(target: Path, alias: Path) -> None:
    """Point ``alias`` (``last.pt``, ``best.pt``) at ``target`` in one rename."""
    tmp = alias.with_name(f".{alias.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError:  # no hard links here (some network file systems): a copy, written atomically
        atomic_write(alias, target.read_bytes(), durable=True)
        return
    os.replace(tmp, alias)
    fsync_directory(alias.parent)


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Delete temporary files of writes that a crash interrupted (they were never visible)."""
    removed = []
    if directory.is_dir():
        for path in [*directory.glob(TEMPORARY_GLOB), *directory.glob(f"*{RANKS_SUFFIX}/{TEMPORARY_GLOB}")]:
            path.unlink(missing_ok=True)
            removed.append(str(path.relative_to(directory)))
    return removed


#: Each rank's own part of a single-file checkpoint (its RNG streams): ``step-N.ranks/rank-R.pt``.
RANKS_SUFFIX = ".ranks"


def rank_part_path(directory: Path, global_step: int, rank: int) -> Path:
    return directory / f"step-{global_step:08d}{RANKS_SUFFIX}" / f"rank-{rank:05d}.pt"


def save_rank_part(directory: Path, global_step: int, rank: int, part: Mapping[str, Any]) -> Path:
    """Each rank writes its own small file (no gather to rank 0, whose load would grow with
    the ranks), before rank 0's file makes the checkpoint count."""
    path = rank_part_path(directory, global_step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_atomic(part, path)


def load_rank_part(directory: Path, global_step: int, rank: int) -> dict[str, Any]:
    """This rank's part of a checkpoint; empty (logged) when it is missing or unreadable:
    the RNG streams then start afresh, the checkpoint itself is still good."""
    path = rank_part_path(directory, global_step, rank)
    try:
        part = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        log.warning("rank %d's part of checkpoint step %d (%s) is missing: its RNG streams start afresh",
                    rank, global_step, path)
        return {}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same refusal
        log.warning("rank %d's part of checkpoint step %d (%s) is unreadable (%s): its RNG streams start afresh",
                    rank, global_step, path, type(exc).__name__)
        return {}
    return part if isinstance(part, dict) else {}


def step_path(directory: Path, global_step: int) -> Path:
    return directory / f"step-{global_step:08d}.pt"


def periodic_checkpoints(directory: Path) -> list[Path]:
    """Periodic checkpoint files, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _STEP_FILE.match(p.name))


def prune(directory: Path, keep_last: int, refused: frozenset[Path] = frozenset()) -> None:
    """Delete all but the newest ``keep_last`` periodic files (last/best links stay valid).

    ``refused``: files a resume found unreadable; they neither count nor are deleted (kept
    for the user to look at), so ``keep_last`` readable ones stay. The file written last is
    never deleted either, whatever its step: unreadable files sort after it.
    """
    files = [path for path in periodic_checkpoints(directory) if path not in refused]
    if not files:
        return
    written_last = max(files, key=lambda path: (path.stat().st_mtime_ns, path.name))
    for old in files[:-keep_last]:
        if old != written_last:
            old.unlink(missing_ok=True)
            shutil.rmtree(old.with_suffix(RANKS_SUFFIX), ignore_errors=True)


def write_checkpoint(state: Mapping[str, Any], path: Path, *, best: bool, keep_last: int,
                     refused: frozenset[Path] = frozenset()) -> Path:
    """The whole save: ``path`` atomically, ``last.pt`` (and ``best.pt``) re-pointed at it
    once it is complete, old periodic files pruned. Synchronous saves call it on the
    training thread, ``checkpoint.async`` saves from the background writer."""
    save_atomic(state, path)
    link_atomic(path, path.parent / LAST_CHECKPOINT)
    if best:
        link_atomic(path, path.parent / BEST_CHECKPOINT)
    prune(path.parent, keep_last, refused - {path})
    return path


#: The first bytes of a ``torch.save`` file: a zip archive (torch >= 1.6), or a pickle (older torch).
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"
_UNSUPPORTED_GLOBAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)")


def _not_a_torch_file(path: Path) -> str | None:
    """What rules ``path`` out before torch reads it, in the user's words; None when it may be one."""
    if path.is_dir():
        return "is a folder, not a checkpoint file"
    with open(path, "rb") as handle:
        head = handle.read(len(_ZIP_MAGIC))
    if not head:
        return "is unreadable (truncated or corrupt: it is empty, 0 bytes)"
    if head != _ZIP_MAGIC and not head.startswith(_PICKLE_MAGIC):
        return "is not a checkpoint file: its bytes are not what torch.save writes (text, or another kind of file)"
    return None


def unsupported_global(exc: pickle.UnpicklingError) -> str | None:
    """The class a weights-only load refused, from torch's long message (None: another error)."""
    found = _UNSUPPORTED_GLOBAL.search(str(exc))
    return found.group(1) if found else None


def _why_unreadable(path: Path, exc: BaseException) -> str:
    """Why torch could not read ``path``, in the user's words (torch's own text names its internals)."""
    if isinstance(exc, pickle.UnpicklingError):
        found = unsupported_global(exc)
        if found:
            return (f"holds objects other than tensors and plain data ({found}) and is refused: "
                    "checkpoints are read weights-only, never running code from a file")
        return "is unreadable (truncated or corrupt: its contents are not what torch.save writes)"
    try:  # torch's errors on a damaged archive (a RuntimeError, an OSError of a seek past the end) say little
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        return (f"is unreadable (truncated or corrupt: its end is missing, {path.stat().st_size} bytes, as a write "
                "or a copy that did not finish leaves it)")
    except OSError as error:
        return f"cannot be read: {error.strerror or type(error).__name__}"
    if not any(name.endswith("/data.pkl") for name in names):
        return "is a zip archive, not a checkpoint torch.save wrote"
    return "is unreadable (truncated or corrupt: parts of it cannot be read back)"


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``: tensors and plain data only, no code.
    A file that cannot be used is refused with what is wrong with it (a ``CheckpointError``)."""
    try:
        problem = _not_a_torch_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        problem = f"cannot be read: {exc.strerror or type(exc).__name__}"
    if problem is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} does not exist") from None
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, KeyError,
                IndexError, TypeError, UnicodeDecodeError, AttributeError) as exc:
            problem = _why_unreadable(path, exc)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} {problem}")
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a ddp_hpc checkpoint (format {FORMAT_VERSION})")
    return state


def newest_loadable(directory: Path, *, report: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that loads; broken ones are skipped (logged where ``report``)."""
    return scan(directory, report=report).found


@dataclass(frozen=True)
class Scan:
    """What a resume found in a checkpoint folder: the newest checkpoint that loads (None:
    there is none) and the periodic files newer than it that were refused."""

    found: tuple[Path, dict[str, Any]] | None
    refused: frozenset[Path]


def scan(directory: Path, *, report: bool = True) -> Scan:
    """The newest checkpoint in ``directory`` that loads; broken ones are skipped, each
    logged in one line where ``report`` (one rank reports for all: they all see the same).

    Every save writes a periodic file, so those are tried newest first; ``last.pt`` is the
    fallback for a folder whose periodic files were removed by hand. None when there is no
    checkpoint at all; a ``CheckpointError`` when there are some and none can be read:
    starting over then would silently throw the run away (a transient read failure on a
    parallel file system looks just like this), so the user decides.
    """
    skipped: list[CheckpointError] = []
    tried: list[Path] = []
    for path in [*reversed(periodic_checkpoints(directory)), directory / LAST_CHECKPOINT,
                 directory / BEST_CHECKPOINT]:
        if not path.exists():
            continue
        try:
            found = path, load_checkpoint(path)
        except CheckpointError as exc:
            skipped.append(exc)
            tried.append(path)
            continue
        for exc in skipped if report else ():  # only now: when none loads, the one line below says it all
            log.warning("%s; using an older one", exc)
        return Scan(found, frozenset(p for p in tried if _STEP_FILE.match(p.name)))
    if tried:
        shown = ", ".join(p.name for p in tried[:4]) + (f" and {len(tried) - 4} more" if len(tried) > 4 else "")
        raise CheckpointError(f"none of the {len(tried)} checkpoint(s) in {directory} can be read ({shown}); "
                              "nothing was deleted: restore them, or start over with checkpoint.resume=never")
    return Scan(None, frozenset())


def check_same_job(found: tuple[Path, dict[str, Any]], job_name: str) -> tuple[Path, dict[str, Any]]:
    """``found`` if its checkpoint was written by ``job_name``; a ``CheckpointError`` if another job wrote it."""
    path, state = found
    written_by = (state.get("config") or {}).get("job", {}).get("name")
    if written_by is not None and written_by != job_name:
        raise CheckpointError(f"checkpoint {path} was written by job {written_by!r}, this run's job is "
                              f"{job_name!r}: use another logging.name or checkpoint.resume, or start over with "
                              "checkpoint.resume=never")
    return found


def adapt_state_dict(state: Mapping[str, torch.Tensor], model: nn.Module, source: str) -> dict[str, torch.Tensor]:
    """``state`` with its ``module.`` prefixes made to match ``model``, shapes checked."""
    expected = model.state_dict()
    adapted = dict(state)
    if set(adapted) != set(expected):  # keys that match as they are (an AveragedModel's) stay
        wants_prefix = all(k.startswith("module.") for k in expected)
        adapted = {}
        for key, value in state.items():
            bare = key[len("module."):] if key.startswith("module.") else key
            adapted[f"module.{bare}" if wants_prefix else bare] = value
    missing = sorted(set(expected) - set(adapted))
    unexpected = sorted(set(adapted) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {source} is from a different model: "
            + "; ".join(part for part in (
                f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else "",
                f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}"
                if unexpected else "") if part))
    for key, tensor in expected.items():
        if tuple(adapted[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {source} is from a different model: {key} has shape "
                                  f"{list(adapted[key].shape)} there but {list(tensor.shape)} here")
    return adapted

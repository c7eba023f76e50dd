"""Checkpoints for any training loop: save a dict of objects at a cadence, restore the newest.

    checkpointer = Checkpointer("runs/mine", {"model": model, "optimizer": optimizer,
                                              "sampler": sampler}, every_n_steps=50)
    checkpointer.restore()          # the newest readable checkpoint, if any
    ...                             # after each optimizer step, on every rank:
    checkpointer.step_done()        # counts the step, saves at the cadence

Each object is anything with ``state_dict()``/``load_state_dict()`` (model, optimizer, LR
scheduler, grad scaler, ``ResumableSampler``); ``extras`` is a dict of plain data the
checkpoint carries too. Every rank's RNG streams are saved and restored, so a resumed run
continues bit-identically. Where the files go and how they are written is the *format*:
``SingleFileFormat`` (one ``torch.save`` file that rank 0 writes, atomically, optionally
in the background, the newest ``keep_last`` kept) is the one there is; a sharded format
plugs in through ``CheckpointFormat``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from ddp_hpc.contract import CHECKPOINTS_DIR
from ddp_hpc.engine import checkpoint_files as files
from ddp_hpc.engine.background_writer import AsyncCheckpointWriter, WriteRecord
from ddp_hpc.engine.group import Collectives, ProcessGroupView
from ddp_hpc.engine.rng import capture_rng, restore_rng
from ddp_hpc.engine.sampler import ResumableSampler

log = logging.getLogger(__name__)

#: Keys of a checkpoint that the Checkpointer itself fills; objects and extras take others.
RESERVED = ("format", "step", "rng", "world_size", "extras", "progress")


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back: where from, its contents, and this rank's part of them
    (``mine``: empty when it was written by another world size)."""

    path: Path
    state: dict[str, Any]
    mine: dict[str, Any] = field(default_factory=dict)


class CheckpointFormat(Protocol):
    """How checkpoints are laid out in a folder. Every rank calls every method."""

    def save(self, group: Collectives, directory: Path, step: int, shared: dict[str, Any],
             per_rank: dict[str, Any], *, keep_last: int, best: bool = False) -> Path:
        """Write one checkpoint: ``shared`` (the same on every rank; rank 0's is used) and
        each rank's ``per_rank``; whole or not at all. ``best``: also name it the best one."""
        ...

    def newest(self, group: Collectives, directory: Path) -> Loaded | None:
        """The newest readable checkpoint, or None when there is none. Unreadable ones are
        refused in one line and kept."""
        ...

    def read(self, group: Collectives, path: Path) -> Loaded:
        """The checkpoint at ``path`` (a ``CheckpointError`` when it cannot be read)."""
        ...

    def prestage(self, group: Collectives, shared: dict[str, Any]) -> None:
        """Prepare for saves of ``shared``'s shape ahead of the first (may do nothing)."""
        ...

    def finished(self) -> list[WriteRecord]:
        """The writes completed since the last call, without waiting for one in flight."""
        ...

    def wait(self) -> list[WriteRecord]:
        """Block until no write is in flight; the writes finished since the last call."""
        ...


class SingleFileFormat:
    """One file per checkpoint, ``step-NNNNNNNN.pt``, that rank 0 writes: every rank's
    ``per_rank`` part is gathered to it. ``background``: rank 0 copies the state to host
    memory and a thread writes it (the previous write finishes before the next begins)."""

    def __init__(self, *, background: bool = False) -> None:
        self.writer = AsyncCheckpointWriter() if background else None
        self._finished: list[WriteRecord] = []

    def save(self, group: Collectives, directory: Path, step: int, shared: dict[str, Any],
             per_rank: dict[str, Any], *, keep_last: int, best: bool = False) -> Path:
        gathered = group.gather_object(per_rank)
        path = files.step_path(directory, step)
        if not group.is_rank_zero:
            return path
        state = {**shared, "per_rank": gathered, "world_size": group.world_size}
        write = partial(files.write_checkpoint, path=path, best=best, keep_last=keep_last)
        if self.writer is not None:
            self._finished.extend(self.writer.submit(state, path, write))
        else:
            started = time.perf_counter()
            write(state)
            elapsed = time.perf_counter() - started
            self._finished.append(WriteRecord(path, elapsed, elapsed))
        return path

    def newest(self, group: Collectives, directory: Path) -> Loaded | None:
        found = files.newest_loadable(directory)
        return self._split(group, *found) if found is not None else None

    def read(self, group: Collectives, path: Path) -> Loaded:
        return self._split(group, path, files.load_checkpoint(path))

    @staticmethod
    def _split(group: Collectives, path: Path, state: dict[str, Any]) -> Loaded:
        parts = state.pop("per_rank", None) or []
        mine = parts[group.rank] if len(parts) == group.world_size else {}
        return Loaded(path, state, mine)

    def prestage(self, group: Collectives, shared: dict[str, Any]) -> None:
        if self.writer is not None and group.is_rank_zero:
            self.writer.prestage(shared)

    def finished(self) -> list[WriteRecord]:
        done, self._finished = self._finished, []
        return done

    def wait(self) -> list[WriteRecord]:
        waited = self.writer.wait() if self.writer is not None else []
        return [*self.finished(), *waited]


def _unwrapped(obj: Any) -> Any:
    """A DDP model's own module: checkpoints hold weights without the wrapper's "module." prefix."""
    return obj.module if isinstance(obj, nn.parallel.DistributedDataParallel) else obj


def find_checkpoint(group: Collectives, directory: Path, file_format: CheckpointFormat,
                    path: str | Path | None = None) -> Loaded | None:
    """The newest readable checkpoint in ``directory`` (None: a fresh start), or the one at
    ``path``, read but not applied: a caller can look into it (which world size wrote it,
    with which settings) before building what it restores into. Every rank calls it."""
    if path is not None:
        return file_format.read(group, Path(path))
    if group.is_rank_zero:
        for name in files.remove_stale_temporaries(directory):
            log.info("removed %s, left by a checkpoint write that was interrupted", name)
    group.barrier()  # no rank reads while rank 0 tidies
    return file_format.newest(group, directory)


class Checkpointer:
    """Saves ``objects`` (and ``extras``) into ``folder``/checkpoints at a step cadence and
    restores the newest readable checkpoint. Every rank makes every call.

    An object may be None (an LR scheduler not in use): the checkpoint then holds None
    under its name, and restoring leaves it alone. ``on_written`` hears, on rank 0, of
    each checkpoint once its file is complete (a background write: at the next save or
    ``wait``). A ``ResumableSampler`` among the objects puts its place in the epoch into
    the checkpoint's ``progress`` next to the step.
    """

    def __init__(self, folder: str | Path, objects: Mapping[str, Any], *, every_n_steps: int = 0,
                 keep_last: int = 3, background: bool = False, extras: dict[str, Any] | None = None,
                 file_format: CheckpointFormat | None = None, group: Collectives | None = None,
                 on_written: Callable[[WriteRecord], None] | None = None) -> None:
        clash = sorted(set(objects) & {*RESERVED, "per_rank"})
        if clash:
            raise ValueError(f"Checkpointer: object name(s) {', '.join(clash)} are reserved")
        for name, obj in objects.items():
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"Checkpointer: {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        if every_n_steps < 0 or keep_last < 1:
            raise ValueError(f"Checkpointer: every_n_steps={every_n_steps} must be >= 0 and keep_last={keep_last} >= 1")
        self.directory = Path(folder) / CHECKPOINTS_DIR
        self.objects = dict(objects)
        self.extras: dict[str, Any] = extras if extras is not None else {}
        self.every_n_steps, self.keep_last = every_n_steps, keep_last
        self.format: CheckpointFormat = file_format or SingleFileFormat(background=background)
        self.group: Collectives = group or ProcessGroupView.current()
        self.on_written = on_written
        #: Optimizer steps taken in all (restored by ``restore``).
        self.step = 0
        #: Seconds the latest save kept training waiting (the stop agreement's deadline uses it).
        self.last_save_s = 0.0
        self._saved_step: int | None = None
        self._sampler = next((obj for obj in self.objects.values() if isinstance(obj, ResumableSampler)), None)

    def find(self, path: str | Path | None = None) -> Loaded | None:
        """The checkpoint ``restore`` would load, read but not applied (see ``find_checkpoint``)."""
        return find_checkpoint(self.group, self.directory, self.format, path)

    def restore(self, loaded: Loaded | None = None) -> Path | None:
        """Load the newest readable checkpoint (or ``loaded``, from ``find``) into the
        objects, the extras and this rank's RNG streams; the path it came from, or None
        (nothing saved yet: a fresh start)."""
        loaded = loaded if loaded is not None else self.find()
        if loaded is None:
            return None
        state = loaded.state
        missing = sorted(set(self.objects) - set(state))
        if missing:
            raise files.CheckpointError(f"checkpoint {loaded.path} holds no {', '.join(missing)}: it was "
                                        "written for other objects")
        for name, obj in self.objects.items():
            value = state[name]
            if obj is None or value is None:
                continue
            if isinstance(obj, nn.Module):
                target = _unwrapped(obj)
                target.load_state_dict(files.adapt_state_dict(value, target, str(loaded.path)))
            else:
                obj.load_state_dict(value)
        self.extras.update(state.get("extras") or {})
        self.step = self._saved_step = int(state["step"])
        if "rng" in loaded.mine:
            restore_rng(loaded.mine["rng"])
        elif self.group.is_rank_zero:
            log.warning("checkpoint %s was written by %s ranks, this run has %d: the RNG streams start afresh",
                        loaded.path, state.get("world_size"), self.group.world_size)
        if self.group.is_rank_zero:
            log.info("resuming from %s (step %d)", loaded.path, self.step)
        return loaded.path

    def step_done(self, batches: int = 1) -> Path | None:
        """After an optimizer step: count it (and ``batches`` batches for the samplers among
        the objects), save if the cadence says so; the checkpoint's path, or None."""
        self.step += 1
        for obj in self.objects.values():
            advance = getattr(obj, "advance", None)
            if callable(advance):
                advance(batches)
        if self.every_n_steps and self.step % self.every_n_steps == 0:
            return self.save()
        return None

    def _state_of(self, obj: Any) -> Any:
        if obj is None:
            return None
        if hasattr(obj, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: a collective, then rank 0 holds it
            obj.consolidate_state_dict(to=0)
            return obj.state_dict() if self.group.is_rank_zero else None
        return _unwrapped(obj).state_dict()

    def progress(self) -> dict[str, int]:
        """Where training stands: the step, and the sampler's place in the epoch if there is one."""
        return {**(self._sampler.progress() if self._sampler is not None else {}), "global_step": self.step}

    def save(self, *, wait: bool = False, best: bool = False) -> Path:
        """Save now (unless this step is saved already). In the background, training waits
        only for the previous write and a copy to host memory; ``wait``: return once the
        file is on disk (see ``wait``). ``best``: also point ``best.pt`` at it."""
        path = files.step_path(self.directory, self.step)
        if self._saved_step == self.step:
            if wait:
                self.wait()
            return path
        started = time.perf_counter()
        shared = {name: self._state_of(obj) for name, obj in self.objects.items()}
        shared.update(format=files.FORMAT_VERSION, step=self.step, extras=dict(self.extras),
                      progress=self.progress())
        self.format.save(self.group, self.directory, self.step, shared, {"rng": capture_rng()},
                         keep_last=self.keep_last, best=best)
        self._saved_step = self.step
        self.last_save_s = time.perf_counter() - started
        self._report(self.format.finished())
        if wait:
            self.wait()
        return path

    def prestage(self, names: Iterable[str] | None = None) -> None:
        """Ahead of the first background save (after the first step, once the optimizer has
        state): let the format allocate what saves of this shape need, in the background.
        ``names``: the objects worth it (default: all). A state that needs a collective to
        gather (ZeRO's optimizer) is left out."""
        chosen = self.objects if names is None else {name: self.objects.get(name) for name in names}
        shared = {name: _unwrapped(obj).state_dict() for name, obj in chosen.items()
                  if obj is not None and not hasattr(obj, "consolidate_state_dict")}
        self.format.prestage(self.group, shared)

    def wait(self, *, together: bool = True) -> None:
        """Block until the last checkpoint is on disk on every rank's behalf (a background
        write finished); call it before the process exits. ``together``: then wait for
        every rank (a barrier); not on an error path, where another rank may be gone."""
        started = time.perf_counter()
        self._report(self.format.wait())
        if together:
            self.group.barrier()
        self.last_save_s = max(self.last_save_s, time.perf_counter() - started)

    def _report(self, records: list[WriteRecord]) -> None:
        for record in records:
            log.debug("checkpoint %s written in %.3fs (training blocked %.3fs)", record.path, record.write_s,
                      record.snapshot_s)
            if self.on_written is not None:
                self.on_written(record)

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
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from ddp_hpc.engine import checkpoint_files as files
from ddp_hpc.engine.background_writer import AsyncCheckpointWriter, WriteRecord
from ddp_hpc.engine.group import Collectives, ProcessGroupView
from ddp_hpc.engine.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)

#: Keys of a checkpoint that the Checkpointer itself fills; objects and extras take others.
RESERVED = ("format", "step", "rng", "world_size", "extras", "progress")


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back: where from, and its contents."""

    path: Path
    state: dict[str, Any]


class CheckpointFormat(Protocol):
    """How checkpoints are laid out in a folder. Every rank calls both methods."""

    def save(self, group: Collectives, directory: Path, step: int, shared: dict[str, Any],
             per_rank: dict[str, Any], *, keep_last: int) -> Path:
        """Write one checkpoint: ``shared`` (the same on every rank; rank 0's is used) and
        each rank's ``per_rank``; whole or not at all."""
        ...

    def newest(self, group: Collectives, directory: Path) -> tuple[Loaded, dict[str, Any]] | None:
        """The newest readable checkpoint and this rank's ``per_rank`` part of it (empty when
        written by another world size), or None when there is none. Unreadable ones are
        refused in one line and kept."""
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

    def save(self, group: Collectives, directory: Path, step: int, shared: dict[str, Any],
             per_rank: dict[str, Any], *, keep_last: int) -> Path:
        gathered = group.gather_object(per_rank)
        path = files.step_path(directory, step)
        if not group.is_rank_zero:
            return path
        state = {**shared, "per_rank": gathered, "world_size": group.world_size}
        write = partial(files.write_checkpoint, path=path, best=False, keep_last=keep_last)
        if self.writer is not None:
            self.writer.submit(state, path, write)
        else:
            write(state)
        return path

    def newest(self, group: Collectives, directory: Path) -> tuple[Loaded, dict[str, Any]] | None:
        found = files.newest_loadable(directory)
        if found is None:
            return None
        path, state = found
        parts = state.pop("per_rank", None) or []
        mine = parts[group.rank] if len(parts) == group.world_size else {}
        return Loaded(path, state), mine

    def wait(self) -> list[WriteRecord]:
        return self.writer.wait() if self.writer is not None else []


def _unwrapped(obj: Any) -> Any:
    """A DDP model's own module: checkpoints hold weights without the wrapper's "module." prefix."""
    return obj.module if isinstance(obj, nn.parallel.DistributedDataParallel) else obj


def _state_of(obj: Any) -> Any:
    return _unwrapped(obj).state_dict()


class Checkpointer:
    """Saves ``objects`` (and ``extras``) into ``folder``/checkpoints at a step cadence and
    restores the newest readable checkpoint. Every rank makes every call."""

    def __init__(self, folder: str | Path, objects: Mapping[str, Any], *, every_n_steps: int = 0,
                 keep_last: int = 3, background: bool = False, extras: dict[str, Any] | None = None,
                 file_format: CheckpointFormat | None = None, group: Collectives | None = None) -> None:
        clash = sorted(set(objects) & {*RESERVED, "per_rank"})
        if clash:
            raise ValueError(f"Checkpointer: object name(s) {', '.join(clash)} are reserved")
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"Checkpointer: {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        if every_n_steps < 0 or keep_last < 1:
            raise ValueError(f"Checkpointer: every_n_steps={every_n_steps} must be >= 0 and keep_last={keep_last} >= 1")
        self.directory = Path(folder) / "checkpoints"
        self.objects = dict(objects)
        self.extras: dict[str, Any] = extras if extras is not None else {}
        self.every_n_steps, self.keep_last = every_n_steps, keep_last
        self.format: CheckpointFormat = file_format or SingleFileFormat(background=background)
        self.group: Collectives = group or ProcessGroupView.current()
        #: Optimizer steps taken in all (restored by ``restore``).
        self.step = 0
        #: Seconds the latest save kept training waiting (the stop agreement's deadline uses it).
        self.last_save_s = 0.0
        self._saved_step: int | None = None

    def restore(self) -> Path | None:
        """Load the newest readable checkpoint into the objects, the extras and this rank's
        RNG streams; the path it came from, or None (nothing saved yet: a fresh start)."""
        if self.group.is_rank_zero:
            for name in files.remove_stale_temporaries(self.directory):
                log.info("removed %s, left by a checkpoint write that was interrupted", name)
        self.group.barrier()  # no rank reads while rank 0 tidies
        found = self.format.newest(self.group, self.directory)
        if found is None:
            return None
        loaded, mine = found
        state = loaded.state
        missing = sorted(set(self.objects) - set(state))
        if missing:
            raise files.CheckpointError(f"checkpoint {loaded.path} holds no {', '.join(missing)}: it was "
                                        "written for other objects")
        for name, obj in self.objects.items():
            value = state[name]
            if isinstance(obj, nn.Module):
                target = _unwrapped(obj)
                target.load_state_dict(files.adapt_state_dict(value, target, str(loaded.path)))
            else:
                obj.load_state_dict(value)
        self.extras.update(state.get("extras") or {})
        self.step = self._saved_step = int(state["step"])
        if "rng" in mine:
            restore_rng(mine["rng"])
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

    def save(self, *, wait: bool = False) -> Path:
        """Save now (unless this step is saved already). In the background, training waits
        only for the previous write and a copy to host memory; ``wait``: return once the
        file is on disk (see ``wait``)."""
        path = files.step_path(self.directory, self.step)
        if self._saved_step == self.step:
            if wait:
                self.wait()
            return path
        started = time.perf_counter()
        shared = {name: _state_of(obj) for name, obj in self.objects.items()}
        shared.update(format=files.FORMAT_VERSION, step=self.step, extras=dict(self.extras),
                      progress={"global_step": self.step})
        self.format.save(self.group, self.directory, self.step, shared, {"rng": capture_rng()},
                         keep_last=self.keep_last)
        self._saved_step = self.step
        self.last_save_s = time.perf_counter() - started
        if wait:
            self.wait()
        return path

    def wait(self) -> None:
        """Block until the last checkpoint is on disk on every rank's behalf (a background
        write finished); call it before the process exits."""
        started = time.perf_counter()
        for record in self.format.wait():
            log.debug("checkpoint %s written in the background in %.3fs", record.path, record.write_s)
        self.group.barrier()
        self.last_save_s = max(self.last_save_s, time.perf_counter() - started)

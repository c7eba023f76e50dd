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
in the background, the newest ``keep_last`` kept; each rank's RNG in a small file of its
own) or ``format="dcp"``: ``ShardedFormat``, a folder that every rank writes its part of,
in parallel (torch.distributed.checkpoint; needed for FSDP2 models). Others plug in
through ``CheckpointFormat``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddp_hpc.engine import checkpoint_files as files
from ddp_hpc.engine.background_writer import AsyncCheckpointWriter, WriteRecord
from ddp_hpc.engine.group import Collectives, ProcessGroupView
from ddp_hpc.engine.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)

#: Keys of a checkpoint that the Checkpointer itself fills; objects and extras take others.
RESERVED = ("format", "step", "rng", "world_size", "extras", "progress", "objects")


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back into the objects: where from, its own data (step, extras,
    ...) and this rank's part (empty when another world size wrote it)."""

    path: Path
    state: dict[str, Any]
    mine: dict[str, Any]


class CheckpointFormat(Protocol):
    """How checkpoints are laid out in a folder. Every rank calls every method."""

    def save(self, group: Collectives, directory: Path, step: int, objects: Mapping[str, Any],
             shared: dict[str, Any], per_rank: dict[str, Any], *, keep_last: int) -> Path:
        """Write one checkpoint of the live ``objects``, ``shared`` (the same on every rank)
        and each rank's ``per_rank``; whole or not at all."""
        ...

    def restore(self, group: Collectives, directory: Path, objects: Mapping[str, Any]) -> Loaded | None:
        """Load the newest readable checkpoint into ``objects``; None when there is none.
        Unreadable ones are refused in one line and kept."""
        ...

    def wait(self) -> list[WriteRecord]:
        """Block until no write is in flight; the writes finished since the last call."""
        ...


class SingleFileFormat:
    """One file per checkpoint, ``step-NNNNNNNN.pt``, that rank 0 writes, and each rank's
    ``per_rank`` part in a small file of its own beside it (``step-NNNNNNNN.ranks/``),
    written before rank 0's file: nothing that grows with the world size reaches rank 0.
    ``background``: rank 0 copies the state to host memory and a thread writes it (the
    previous write finishes before the next begins)."""

    def __init__(self, *, background: bool = False) -> None:
        self.writer = AsyncCheckpointWriter() if background else None

    def save(self, group: Collectives, directory: Path, step: int, objects: Mapping[str, Any],
             shared: dict[str, Any], per_rank: dict[str, Any], *, keep_last: int) -> Path:
        path = files.step_path(directory, step)
        files.save_rank_part(directory, step, group.rank, per_rank)
        group.barrier()  # every rank's part is on disk before the file that makes it count
        if not group.is_rank_zero:
            return path
        state = {**{name: _state_of(obj) for name, obj in objects.items()}, **shared,
                 "world_size": group.world_size}
        write = partial(files.write_checkpoint, path=path, best=False, keep_last=keep_last)
        if self.writer is not None:
            self.writer.submit(state, path, write)
        else:
            write(state)
        return path

    def restore(self, group: Collectives, directory: Path, objects: Mapping[str, Any]) -> Loaded | None:
        found = files.newest_loadable(directory)
        if found is None:
            return None
        path, state = found
        missing = sorted(set(objects) - set(state))
        if missing:
            raise files.CheckpointError(f"checkpoint {path} holds no {', '.join(missing)}: it was "
                                        "written for other objects")
        for name, obj in objects.items():
            value = state[name]
            if isinstance(obj, nn.Module):
                target = _unwrapped(obj)
                target.load_state_dict(files.adapt_state_dict(value, target, str(path)))
            else:
                obj.load_state_dict(value)
        mine: dict[str, Any] = {}
        if state.get("world_size") == group.world_size:
            mine = files.load_rank_part(directory, int(state["step"]), group.rank)
        return Loaded(path, state, mine)

    def wait(self) -> list[WriteRecord]:
        return self.writer.wait() if self.writer is not None else []


class ShardedFormat:
    """``format="dcp"``: a folder per checkpoint that every rank writes its part of
    (``ddp_hpc.engine.dcp_format``). Modules and optimizers are saved sharded (FSDP2) or
    dealt out over the ranks (DDP); the other objects' state (samplers, schedulers) is
    the same on every rank and saved once; the RNG streams in each rank's own file."""

    def __init__(self, *, background: bool = False) -> None:
        from ddp_hpc.engine.dcp_format import DcpFormat

        self.dcp = DcpFormat(background=background)

    @staticmethod
    def _parts(objects: Mapping[str, Any]) -> tuple[dict[str, nn.Module], dict[str, tuple[nn.Module, Any]],
                                                    dict[str, Any]]:
        modules = {name: obj for name, obj in objects.items() if isinstance(obj, nn.Module)}
        optimizers, others = {}, {}
        for name, obj in objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                optimizers[name] = (_module_of(name, obj, modules), obj)
            elif name not in modules:
                others[name] = obj
        return modules, optimizers, others

    def save(self, group: Collectives, directory: Path, step: int, objects: Mapping[str, Any],
             shared: dict[str, Any], per_rank: dict[str, Any], *, keep_last: int) -> Path:
        from ddp_hpc.engine.dcp_format import ShardedState

        modules, optimizers, others = self._parts(objects)
        state = ShardedState(modules, optimizers, {**shared, "world_size": group.world_size,
                                                   "objects": {name: obj.state_dict() for name, obj in others.items()}},
                             per_rank)
        return self.dcp.save(group, directory, step, state, keep_last=keep_last)

    def restore(self, group: Collectives, directory: Path, objects: Mapping[str, Any]) -> Loaded | None:
        from ddp_hpc.engine.dcp_format import ShardedState

        path = self.dcp.newest(group, directory)
        if path is None:
            return None
        modules, optimizers, others = self._parts(objects)
        restored = self.dcp.load(group, path, ShardedState(modules, optimizers))
        saved = restored.shared.get("objects") or {}
        missing = sorted(set(others) - set(saved))
        if missing:
            raise files.CheckpointError(f"checkpoint {path} holds no {', '.join(missing)}: it was "
                                        "written for other objects")
        for name, obj in others.items():
            obj.load_state_dict(saved[name])
        return Loaded(path, restored.shared, restored.mine)

    def wait(self) -> list[WriteRecord]:
        return self.dcp.wait()


def _module_of(name: str, optimizer: torch.optim.Optimizer, modules: Mapping[str, nn.Module]) -> nn.Module:
    """The module whose parameters ``optimizer`` steps (DCP names optimizer state by them)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError(f"Checkpointer: optimizer {name!r} steps parameters of no single module among the "
                     "objects: format='dcp' needs the model it steps among them")


def _unwrapped(obj: Any) -> Any:
    """A DDP model's own module: checkpoints hold weights without the wrapper's "module." prefix."""
    return obj.module if isinstance(obj, nn.parallel.DistributedDataParallel) else obj


def _state_of(obj: Any) -> Any:
    return _unwrapped(obj).state_dict()


def make_format(name: str, *, background: bool) -> CheckpointFormat:
    """The format ``checkpoint.format`` names: ``file`` or ``dcp``."""
    if name == "file":
        return SingleFileFormat(background=background)
    if name == "dcp":
        return ShardedFormat(background=background)
    raise ValueError(f"checkpoint format {name!r} is not one of file, dcp")


class Checkpointer:
    """Saves ``objects`` (and ``extras``) into ``folder``/checkpoints at a step cadence and
    restores the newest readable checkpoint. Every rank makes every call."""

    def __init__(self, folder: str | Path, objects: Mapping[str, Any], *, every_n_steps: int = 0,
                 keep_last: int = 3, background: bool = False, extras: dict[str, Any] | None = None,
                 format: str | CheckpointFormat = "file", group: Collectives | None = None) -> None:
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
        self.format: CheckpointFormat = (make_format(format, background=background) if isinstance(format, str)
                                         else format)
        self.group: Collectives = group or ProcessGroupView.current()
        #: Optimizer steps taken in all (restored by ``restore``).
        self.step = 0
        #: Seconds the latest save kept training waiting (the stop agreement's deadline uses it).
        self.last_save_s = 0.0
        self._saved_step: int | None = None
        self._saved_path: Path | None = None

    def restore(self) -> Path | None:
        """Load the newest readable checkpoint into the objects, the extras and this rank's
        RNG streams; the path it came from, or None (nothing saved yet: a fresh start)."""
        if self.group.is_rank_zero:
            for name in files.remove_stale_temporaries(self.directory):
                log.info("removed %s, left by a checkpoint write that was interrupted", name)
        self.group.barrier()  # no rank reads while rank 0 tidies
        loaded = self.format.restore(self.group, self.directory, self.objects)
        if loaded is None:
            return None
        state, mine = loaded.state, loaded.mine
        self.extras.update(state.get("extras") or {})
        self.step = self._saved_step = int(state["step"])
        self._saved_path = loaded.path
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
        if self._saved_step == self.step and self._saved_path is not None:
            if wait:
                self.wait()
            return self._saved_path
        started = time.perf_counter()
        shared = {"format": files.FORMAT_VERSION, "step": self.step, "extras": dict(self.extras),
                  "progress": {"global_step": self.step}}
        self._saved_path = self.format.save(self.group, self.directory, self.step, self.objects, shared,
                                            {"rng": capture_rng()}, keep_last=self.keep_last)
        self._saved_step = self.step
        self.last_save_s = time.perf_counter() - started
        if wait:
            self.wait()
        return self._saved_path

    def wait(self) -> None:
        """Block until the last checkpoint is on disk on every rank's behalf (a background
        write finished); call it before the process exits."""
        started = time.perf_counter()
        for record in self.format.wait():
            log.debug("checkpoint %s written in the background in %.3fs", record.path, record.write_s)
        self.group.barrier()
        self.last_save_s = max(self.last_save_s, time.perf_counter() - started)

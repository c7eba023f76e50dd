"""Checkpoint formats: where a checkpoint's files go and how they are written, under the
``Checkpointer``'s cadence (``checkpointer.py``). ``SingleFileFormat`` (``format="file"``): one
``torch.save`` file that rank 0 writes, atomically, optionally in the background, each rank's RNG
in a small file of its own, a sharded (FSDP2) model and its optimizer gathered whole into it
(``engine/sharding.py``). ``ShardedFormat`` (``format="dcp"``): a folder every rank writes its
part of (``dcp_format.py``). Others plug in through ``CheckpointFormat``. ``sharded_refusal``
names a sharded model the formats cannot save whole (its root not sharded, an optimizer that
steps other tensors than its parameters).
"""


from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddp_hpc.contract import checkpoint_format_of
from ddp_hpc.engine.checkpoint import files as files
from ddp_hpc.engine import sharding
from ddp_hpc.engine.checkpoint.background_writer import AsyncCheckpointWriter, WriteRecord
from ddp_hpc.engine.group import Collectives

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


#: Called with a checkpoint's path and its own data (progress, config, ...) before anything
#: is loaded from it; raises to refuse it.
Accept = Callable[[Path, Mapping[str, Any]], None]

#: Called with a checkpoint's path and its data (a single file's whole dict; a dcp folder's
#: own data with its plain objects beside it) before ``Accept``: returns it in this layout
#: (one written by an older version brought up to date), or raises to refuse it.
Upgrade = Callable[[Path, dict[str, Any]], dict[str, Any]]


class CheckpointFormat(Protocol):
    """How checkpoints are laid out in a folder. Every rank calls every method."""

    def save(self, group: Collectives, directory: Path, step: int, objects: Mapping[str, Any],
             shared: dict[str, Any], per_rank: dict[str, Any], *, keep_last: int, best: bool = False) -> Path:
        """Write one checkpoint of the live ``objects`` (None: saved as None), ``shared``
        (the same on every rank) and each rank's ``per_rank``; whole or not at all.
        ``best``: also name it the best one (``best.pt``)."""
        ...

    def restore(self, group: Collectives, directory: Path, objects: Mapping[str, Any], *,
                path: Path | None = None, accept: Accept | None = None,
                upgrade: Upgrade | None = None) -> Loaded | None:
        """Load the newest readable checkpoint (or the one at ``path``) into ``objects``
        (None, or None saved: left alone); None when there is none. Unreadable ones are
        refused in one line and kept; ``upgrade``, then ``accept``, see its data first."""
        ...

    def prestage(self, group: Collectives, states: Mapping[str, Any]) -> None:
        """Prepare for saves of ``states``' shapes ahead of the first (may do nothing)."""
        ...

    def finished(self) -> list[WriteRecord]:
        """The writes completed since the last call, without waiting for one in flight."""
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
        self._finished: list[WriteRecord] = []
        #: Periodic files the restore refused: pruning neither counts nor deletes them.
        self._refused: frozenset[Path] = frozenset()

    def save(self, group: Collectives, directory: Path, step: int, objects: Mapping[str, Any],
             shared: dict[str, Any], per_rank: dict[str, Any], *, keep_last: int, best: bool = False) -> Path:
        path = files.step_path(directory, step)
        files.save_rank_part(directory, step, group.rank, per_rank)
        # ZeRO's optimizer state, and a sharded (FSDP2) model's and its optimizer's whole state,
        # are gathered to rank 0 by collectives every rank joins, in the objects' order.
        gathered = {name: _consolidated(obj, group) for name, obj in objects.items() if is_sharded_optimizer(obj)}
        gathered.update(_gathered_shards(objects))
        group.barrier()  # every rank's part is on disk before the file that makes it count
        if not group.is_rank_zero:
            return path
        state = {**{name: gathered[name] if name in gathered else state_of(obj) for name, obj in objects.items()},
                 **shared, "world_size": group.world_size}
        self._refused -= {path}  # written again, whole
        write = partial(files.write_checkpoint, path=path, best=best, keep_last=keep_last, refused=self._refused)
        if self.writer is not None:
            self._finished.extend(self.writer.submit(state, path, write))
        else:
            started = time.perf_counter()
            write(state)
            elapsed = time.perf_counter() - started
            self._finished.append(WriteRecord(path, elapsed, elapsed))
        return path

    def restore(self, group: Collectives, directory: Path, objects: Mapping[str, Any], *,
                path: Path | None = None, accept: Accept | None = None,
                upgrade: Upgrade | None = None) -> Loaded | None:
        if path is None:
            scanned = files.scan(directory, report=group.is_rank_zero)
            self._refused = scanned.refused
            if scanned.found is None:
                return None
            path, state = scanned.found
        else:
            if checkpoint_format_of(path) == "dcp":
                raise files.CheckpointError(f"checkpoint {path} is sharded (checkpoint.format=dcp), and this run "
                                            "reads format file: resume it with checkpoint.format=dcp")
            state = files.load_checkpoint(path)
        if upgrade is not None:
            state = upgrade(path, state)
        if accept is not None:
            accept(path, state)
        _load_objects(objects, state, path)
        mine: dict[str, Any] = {}
        if state.get("world_size") == group.world_size:
            mine = files.load_rank_part(path.parent, int(state["step"]), group.rank)
        return Loaded(path, state, mine)

    def prestage(self, group: Collectives, states: Mapping[str, Any]) -> None:
        if self.writer is not None and group.is_rank_zero:
            self.writer.prestage(states)

    def finished(self) -> list[WriteRecord]:
        done, self._finished = self._finished, []
        return done

    def wait(self) -> list[WriteRecord]:
        waited = self.writer.wait() if self.writer is not None else []
        return [*self.finished(), *waited]


class ShardedFormat:
    """``format="dcp"``: a folder per checkpoint that every rank writes its part of
    (``ddp_hpc.engine.checkpoint.dcp_format``). Modules and optimizers are saved sharded (FSDP2) or
    dealt out over the ranks (DDP); the other objects' state (samplers, schedulers) is
    the same on every rank and saved once; the RNG streams in each rank's own file."""

    def __init__(self, *, background: bool = False) -> None:
        from ddp_hpc.engine.checkpoint.dcp_format import DcpFormat

        self.dcp = DcpFormat(background=background)

    @staticmethod
    def _parts(objects: Mapping[str, Any]) -> tuple[dict[str, nn.Module], dict[str, tuple[nn.Module, Any]],
                                                    dict[str, Any]]:
        modules = {name: obj for name, obj in objects.items() if isinstance(obj, nn.Module)}
        optimizers, others = {}, {}
        for name, obj in objects.items():
            if obj is None:
                continue
            if isinstance(obj, torch.optim.Optimizer):
                optimizers[name] = (_module_of(name, obj, modules), obj)
            elif name not in modules:
                others[name] = obj
        return modules, optimizers, others

    def save(self, group: Collectives, directory: Path, step: int, objects: Mapping[str, Any],
             shared: dict[str, Any], per_rank: dict[str, Any], *, keep_last: int, best: bool = False) -> Path:
        from ddp_hpc.engine.checkpoint.dcp_format import ShardedState

        modules, optimizers, others = self._parts(objects)
        saved = {name: obj.state_dict() for name, obj in others.items()}
        saved.update({name: None for name, obj in objects.items() if obj is None})
        state = ShardedState(modules, optimizers, {**shared, "world_size": group.world_size, "objects": saved},
                             per_rank)
        return self.dcp.save(group, directory, step, state, keep_last=keep_last, best=best)

    def restore(self, group: Collectives, directory: Path, objects: Mapping[str, Any], *,
                path: Path | None = None, accept: Accept | None = None,
                upgrade: Upgrade | None = None) -> Loaded | None:
        from ddp_hpc.engine.checkpoint.dcp_format import ShardedState
        from ddp_hpc.engine.checkpoint.dcp_read import SHARED_KEY, check_complete, named_checkpoint, read_blob

        path = self.dcp.newest(group, directory) if path is None else named_checkpoint(Path(path))
        if path is None:
            return None
        if accept is not None:
            data = _flat(read_blob(path, check_complete(path), SHARED_KEY))
            accept(path, upgrade(path, data) if upgrade is not None else data)
        modules, optimizers, others = self._parts(objects)
        restored = self.dcp.load(group, path, ShardedState(modules, optimizers))
        state = _flat(restored.shared)
        if upgrade is not None:
            state = upgrade(path, state)
        _load_objects(others, state, path)
        return Loaded(path, state, restored.mine)

    def prestage(self, group: Collectives, states: Mapping[str, Any]) -> None:
        """Nothing: ``dcp.async_save`` stages into its own host buffers."""

    def finished(self) -> list[WriteRecord]:
        return self.dcp.take_finished()

    def wait(self) -> list[WriteRecord]:
        return self.dcp.wait()


def _flat(shared: Mapping[str, Any]) -> dict[str, Any]:
    """A folder's own data with the plain objects' state beside it, as a single file holds them."""
    flat = {key: value for key, value in shared.items() if key != "objects"}
    return {**flat, **(shared.get("objects") or {})}


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


def state_of(obj: Any) -> Any:
    return _unwrapped(obj).state_dict() if obj is not None else None


def is_sharded_optimizer(obj: Any) -> bool:
    """ZeroRedundancyOptimizer: each rank holds a shard of the state."""
    return hasattr(obj, "consolidate_state_dict")


def _consolidated(obj: Any, group: Collectives) -> Any:
    obj.consolidate_state_dict(to=0)  # a collective: every rank calls it
    return obj.state_dict() if group.is_rank_zero else None


def _load_objects(objects: Mapping[str, Any], saved: Mapping[str, Any], path: Path) -> None:
    """Load each object from ``saved``; a checkpoint that lacks one is refused whole."""
    missing = sorted(set(objects) - set(saved))
    if missing:
        raise files.CheckpointError(f"checkpoint {path} holds no {', '.join(missing)}: it was "
                                    "written for other objects")
    whole = sharded_owners(objects)
    for name, value in saved.items():  # one rank's slices would load into every rank: none is taken
        if name in objects and sharding.holds_shards(value):
            raise files.CheckpointError(f"checkpoint {path} holds one rank's shards of {name!r}, not its whole "
                                        "state (a sharded model saved in one file by an older version): restore "
                                        "a format='dcp' checkpoint, or start afresh")
    for name, obj in objects.items():
        if name in whole and saved[name] is not None:
            _load_whole(obj, whole[name], saved[name], path)
        else:
            _load_into(obj, saved[name], path)


def _load_into(obj: Any, value: Any, path: Path) -> None:
    """Load ``value`` into ``obj``; an object not in use, or one saved as None, is left alone."""
    if obj is None or value is None:
        return
    if isinstance(obj, nn.Module):
        target = _unwrapped(obj)
        target.load_state_dict(files.adapt_state_dict(value, target, str(path)))
    else:
        obj.load_state_dict(value)


def sharded_owners(objects: Mapping[str, Any]) -> dict[str, nn.Module]:
    """The objects whose state the single-file format gathers whole: each sharded (FSDP2)
    model, and each optimizer stepping one, with the sharded model it belongs to."""
    modules = {name: _unwrapped(obj) for name, obj in objects.items() if sharding.is_sharded(_unwrapped(obj))}
    owners: dict[str, nn.Module] = dict(modules)
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer) and modules:
            stepped = {id(p) for group in obj.param_groups for p in group["params"]}
            owner = next((m for m in modules.values() if stepped <= {id(p) for p in m.parameters()}), None)
            if owner is not None:
                owners[name] = owner
    return owners


def _gathered_shards(objects: Mapping[str, Any]) -> dict[str, Any]:
    """The whole state of each sharded model and its optimizer, on rank 0 (None elsewhere)."""
    out: dict[str, Any] = {}
    for name, owner in sharded_owners(objects).items():
        obj = objects[name]
        out[name] = (sharding.whole_optimizer_state(owner, obj) if isinstance(obj, torch.optim.Optimizer)
                     else sharding.whole_model_state(owner))
    return out


def _load_whole(obj: Any, owner: nn.Module, value: Any, path: Path) -> None:
    """Each rank takes its own slice of a whole state that every rank read."""
    if isinstance(obj, torch.optim.Optimizer):
        sharding.load_whole_optimizer(owner, obj, value)
    else:
        sharding.load_whole_model(owner, files.adapt_state_dict(value, owner, str(path)))


def sharded_refusal(objects: Mapping[str, Any]) -> str | None:
    """Why ``objects`` holding a sharded (FSDP2) model would train or save wrongly (one
    line), or None: the root not sharded, or an optimizer that steps other tensors than
    the model's parameters (built before ``fully_shard``, or its model not among them)."""
    modules = [_unwrapped(obj) for obj in objects.values() if isinstance(_unwrapped(obj), nn.Module)]
    for module in modules:
        if (why := sharding.model_refusal(module)) is not None:
            return why
    for name, obj in objects.items():
        if (why := sharding.optimizer_refusal(modules, obj, f"optimizer {name!r}")) is not None:
            return why
        if (isinstance(obj, torch.optim.Optimizer) and not any(sharding.is_sharded(m) for m in modules)
                and sharding.holds_shards([p for group in obj.param_groups for p in group["params"]])):
            return (f"optimizer {name!r} steps a sharded (FSDP2) model that is not among the objects: give the "
                    "model too (a checkpoint holds the two together)")
    return None


def make_format(name: str, *, background: bool) -> CheckpointFormat:
    """The format ``checkpoint.format`` names: ``file`` or ``dcp``."""
    if name == "file":
        return SingleFileFormat(background=background)
    if name == "dcp":
        return ShardedFormat(background=background)
    raise ValueError(f"checkpoint format {name!r} is not one of file, dcp")

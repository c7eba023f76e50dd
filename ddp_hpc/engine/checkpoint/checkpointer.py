"""Checkpoints for any training loop: save a dict of objects at a cadence, restore the newest.

    checkpointer = Checkpointer("runs/mine", {"model": model, "optimizer": optimizer,
                                              "sampler": sampler}, every_n_steps=50)
    checkpointer.restore()          # the newest readable checkpoint, if any
    ...                             # after each optimizer step, on every rank:
    checkpointer.step_done()        # counts the step, saves at the cadence

The cadence is the Checkpointer's alone: ``every_n_steps`` and ``every_n_epochs``, applied
by ``step_done`` (or ``save_due``, for a loop whose step does more bookkeeping after the
count) and ``epoch_done``; a step that ends an epoch (``step_done(epoch_ends=True)``) has
its save put off to ``epoch_done``, so that the epoch's checkpoint holds its end (validation,
the next epoch's start) and is written once. ``StopAgreement`` saves a stop's checkpoint
through ``save_step``, under the same rule.

Each object is anything with ``state_dict()``/``load_state_dict()`` (model, optimizer, LR
scheduler, grad scaler, ``ResumableSampler``); ``extras`` is a dict of plain data the
checkpoint carries too. Every rank's RNG streams are saved and restored, so a resumed run
continues bit-identically. Where the files go and how they are written is the *format*:
``SingleFileFormat`` (one ``torch.save`` file that rank 0 writes, atomically, optionally
in the background, the newest ``keep_last`` kept; each rank's RNG in a small file of its
own; a sharded (FSDP2) model and its optimizer gathered whole into it, ``engine/sharding.py``)
or ``format="dcp"``: ``ShardedFormat``, a folder that every rank writes its part of,
in parallel (torch.distributed.checkpoint; the one for FSDP2 models too large to gather on
one rank). Others plug in through ``CheckpointFormat``. A sharded model whose root is not
sharded, or whose optimizer steps other tensors than its parameters, is refused in one line
(``RefusedOnRank``) when the Checkpointer is made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ddp_hpc.contract import CHECKPOINTS_DIR, checkpoint_format_of
from ddp_hpc.engine.checkpoint import files as files
from ddp_hpc.engine import sharding
from ddp_hpc.engine.checkpoint.background_writer import AsyncCheckpointWriter, WriteRecord
from ddp_hpc.engine.group import Collectives, ProcessGroupView
from ddp_hpc.engine.rng import capture_rng, restore_rng
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.errors import RefusedOnRank

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
        gathered = {name: _consolidated(obj, group) for name, obj in objects.items() if _sharded_optimizer(obj)}
        gathered.update(_gathered_shards(objects))
        group.barrier()  # every rank's part is on disk before the file that makes it count
        if not group.is_rank_zero:
            return path
        state = {**{name: gathered[name] if name in gathered else _state_of(obj) for name, obj in objects.items()},
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
        from ddp_hpc.engine.checkpoint.dcp_format import SHARED_KEY, ShardedState, check_complete, named_checkpoint, read_blob

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


def _state_of(obj: Any) -> Any:
    return _unwrapped(obj).state_dict() if obj is not None else None


def _sharded_optimizer(obj: Any) -> bool:
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
    whole = _sharded_owners(objects)
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


def _sharded_owners(objects: Mapping[str, Any]) -> dict[str, nn.Module]:
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
    for name, owner in _sharded_owners(objects).items():
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


class Checkpointer:
    """Saves ``objects`` (and ``extras``) into ``folder``/checkpoints at a step cadence and
    restores the newest readable checkpoint. Every rank makes every call.

    An object may be None (an LR scheduler not in use): the checkpoint then holds None
    under its name, and restoring leaves it alone. ``on_written`` hears, on rank 0, of
    each checkpoint once it is complete (a background write: at the next save or
    ``wait``). A ``ResumableSampler`` among the objects puts its place in the epoch into
    the checkpoint's ``progress`` next to the step.
    """

    def __init__(self, folder: str | Path, objects: Mapping[str, Any], *, every_n_steps: int = 0,
                 every_n_epochs: int = 0, keep_last: int = 3, background: bool = False,
                 extras: dict[str, Any] | None = None, format: str | CheckpointFormat = "file",
                 group: Collectives | None = None, on_written: Callable[[WriteRecord], None] | None = None,
                 on_saving: Callable[[], None] | None = None) -> None:
        clash = sorted(set(objects) & {*RESERVED, "per_rank"})
        if clash:
            raise ValueError(f"Checkpointer: object name(s) {', '.join(clash)} are reserved")
        for name, obj in objects.items():
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"Checkpointer: {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        if every_n_steps < 0 or every_n_epochs < 0 or keep_last < 1:
            raise ValueError(f"Checkpointer: every_n_steps={every_n_steps} and every_n_epochs={every_n_epochs} "
                             f"must be >= 0 and keep_last={keep_last} >= 1")
        self.directory = Path(folder) / CHECKPOINTS_DIR
        self.objects = dict(objects)
        self.extras: dict[str, Any] = extras if extras is not None else {}
        #: Plain data of this rank's own (its streams' base seed under InJobRecovery, say):
        #: saved in the rank's own part of each checkpoint beside its RNG streams, restored
        #: into this dict where the checkpoint has a part of this rank's.
        self.rank_extras: dict[str, Any] = {}
        #: Called with the step's batches by ``step_done`` once the step is counted and the
        #: samplers advanced, before the cadence's save (in-job recovery's part of a step).
        self.step_listeners: list[Callable[[int], None]] = []
        self.every_n_steps, self.every_n_epochs, self.keep_last = every_n_steps, every_n_epochs, keep_last
        self.format: CheckpointFormat = (make_format(format, background=background) if isinstance(format, str)
                                         else format)
        self.group: Collectives = group or ProcessGroupView.current()
        if (why := sharded_refusal(self.objects)) is not None:
            # The same on every rank, which exits 2. Its group ends first: left to the
            # interpreter's exit, a live gloo group's threads can abort the process (SIGABRT),
            # which reads as a lost rank.
            if dist.is_initialized():
                dist.destroy_process_group()
            raise RefusedOnRank(f"Checkpointer: {why}", self.group.rank)
        self.on_written = on_written
        #: Called on every rank before a save begins (a loop's watchdog beat, say).
        self.on_saving = on_saving
        #: True while ``save`` runs (a part that watches the optimizer's steps tells a save's from the loop's).
        self.saving = False
        #: Optimizer steps taken in all (restored by ``restore``).
        self.step = 0
        #: Seconds the latest save kept training waiting (the stop agreement's deadline uses it).
        self.last_save_s = 0.0
        #: The checkpoint ``restore`` loaded (its path and own data: progress, world size, ...).
        self.resumed: Loaded | None = None
        self._saved_step: int | None = None
        #: The step just counted ends an epoch: its save waits for ``epoch_done``.
        self._epoch_ends = False
        #: A save put off to ``epoch_done``: None, or whether it is to be waited for.
        self._owed: bool | None = None
        self._saved_path: Path | None = None
        self._sampler = next((obj for obj in self.objects.values() if isinstance(obj, ResumableSampler)), None)

    def restore(self, path: str | Path | None = None, *, accept: Accept | None = None,
                upgrade: Upgrade | None = None, quiet: bool = False) -> Path | None:
        """Load the newest readable checkpoint (or the one at ``path``) into the objects,
        the extras and this rank's RNG streams; the path it came from, or None (nothing
        saved yet: a fresh start). ``accept(path, data)`` may refuse it before anything is
        loaded (raise); ``upgrade(path, data)``, called before it, returns a checkpoint of
        an older layout in this one. ``quiet``: rank 0 logs no "resuming from" line (the
        caller logs its own)."""
        if path is None:
            if self.group.is_rank_zero:
                for name in files.remove_stale_temporaries(self.directory):
                    log.info("removed %s, left by a checkpoint write that was interrupted", name)
            self.group.barrier()  # no rank reads while rank 0 tidies
        loaded = self.format.restore(self.group, self.directory, self.objects,
                                     path=Path(path) if path is not None else None, accept=accept,
                                     upgrade=upgrade)
        if loaded is None:
            return None
        state, mine = loaded.state, loaded.mine
        self.extras.update(state.get("extras") or {})
        self.step = self._saved_step = int(state["step"])
        self._saved_path = loaded.path
        self.resumed = loaded
        self.rank_extras.update(mine.get("rank_extras") or {})
        if "rng" in mine:
            restore_rng(mine["rng"])
        elif self.group.is_rank_zero:
            log.warning("checkpoint %s was written by %s ranks, this run has %d: the RNG streams start afresh",
                        loaded.path, state.get("world_size"), self.group.world_size)
        if self.group.is_rank_zero and not quiet:
            log.info("resuming from %s (step %d)", loaded.path, self.step)
        return loaded.path

    def step_done(self, batches: int = 1, *, epoch_ends: bool = False, save: bool = True) -> Path | None:
        """After an optimizer step: count it (and ``batches`` batches for the samplers among
        the objects), then ``save_due``; the checkpoint's path, or None. ``epoch_ends``:
        this step is its epoch's last (its save waits for ``epoch_done``). ``save=False``:
        only count; the loop calls ``save_due`` once its own bookkeeping of the step (state
        the checkpoint holds) is done. The ``step_listeners`` are called between the count
        and the save."""
        self.step += 1
        self._epoch_ends = epoch_ends
        for obj in self.objects.values():
            advance = getattr(obj, "advance", None)
            if callable(advance):
                advance(batches)
        for listener in self.step_listeners:
            listener(batches)
        return self.save_due() if save else None

    def save_due(self) -> Path | None:
        """The step cadence: save this step if ``every_n_steps`` divides it (see ``save_step``)."""
        if self.every_n_steps and self.step % self.every_n_steps == 0:
            return self.save_step()
        return None

    def save_step(self, *, wait: bool = False) -> Path | None:
        """This step's checkpoint: saved now, or, when the step ends an epoch, by
        ``epoch_done`` (the path then; None now). ``wait`` as in ``save``."""
        if self._epoch_ends:
            self._owed = bool(self._owed) or wait
            return None
        return self.save(wait=wait)

    def epoch_done(self, epoch: int, *, save: bool = False, best: bool = False) -> Path | None:
        """At the end of epoch ``epoch`` (counted from 1), once its own work (validation,
        the next epoch's start) is in the objects: save if the epoch cadence
        (``every_n_epochs``) asks for it, a save of its last step was put off to here,
        ``save`` (training ends here, say) or ``best`` (see ``save``); the path, or None."""
        owed, self._owed, self._epoch_ends = self._owed, None, False
        due = (owed is not None or save or best
               or bool(self.every_n_epochs and epoch % self.every_n_epochs == 0))
        return self.save(wait=bool(owed), best=best) if due else None

    def progress(self) -> dict[str, int]:
        """Where training stands: the step, and the sampler's place in the epoch if there is one."""
        return {**(self._sampler.progress() if self._sampler is not None else {}), "global_step": self.step}

    def bookkeeping(self) -> dict[str, Any]:
        """Where this Checkpointer stands, as plain data (in-job recovery hands it to a
        replacement with ``continue_from``): the step, the step saved last and its path, the extras."""
        return {"step": self.step, "saved_step": self._saved_step,
                "saved_path": str(self._saved_path) if self._saved_path is not None else None,
                "extras": dict(self.extras)}

    def continue_from(self, bookkeeping: Mapping[str, Any]) -> None:
        """Stand where ``bookkeeping`` (another rank's) says, with the objects loaded as they
        were there: every rank then saves at the same steps (a save is a collective)."""
        self.step = int(bookkeeping["step"])
        self._saved_step = bookkeeping["saved_step"]
        self._saved_path = Path(bookkeeping["saved_path"]) if bookkeeping["saved_path"] is not None else None
        self.extras.clear()
        self.extras.update(bookkeeping["extras"])
        self._epoch_ends, self._owed = False, None  # the step is done again, and says so again

    def save(self, *, wait: bool = False, best: bool = False) -> Path:
        """Save now (unless this step is saved already). In the background, training waits
        only for the previous write and a copy to host memory; ``wait``: return once the
        file is on disk (see ``wait``). ``best``: also point ``best.pt`` at it."""
        if self._saved_step == self.step and self._saved_path is not None:
            if wait:
                self.wait()
            return self._saved_path
        if self.on_saving is not None:
            self.on_saving()
        started = time.perf_counter()
        shared = {"format": files.FORMAT_VERSION, "step": self.step, "extras": dict(self.extras),
                  "progress": self.progress()}
        self.saving = True
        try:
            self._saved_path = self.format.save(self.group, self.directory, self.step, self.objects, shared,
                                                {"rng": capture_rng(), "rank_extras": dict(self.rank_extras)},
                                                keep_last=self.keep_last, best=best)
        finally:
            self.saving = False
        self._saved_step = self.step
        self.last_save_s = time.perf_counter() - started
        self._report(self.format.finished())
        if wait:
            self.wait()
        return self._saved_path

    def prestage(self, names: Iterable[str] | None = None) -> None:
        """Ahead of the first background save (after the first step, once the optimizer has
        state): let the format allocate what saves of this shape need, in the background.
        ``names``: the objects worth it (default: all). ZeRO's sharded optimizer state,
        which needs a collective to gather, is left out."""
        chosen = self.objects if names is None else {name: self.objects.get(name) for name in names}
        gathered = _sharded_owners(self.objects)
        states = {name: _state_of(obj) for name, obj in chosen.items()
                  if obj is not None and not _sharded_optimizer(obj) and name not in gathered}
        self.format.prestage(self.group, states)

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

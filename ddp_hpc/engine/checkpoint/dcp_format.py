"""Sharded checkpoints (``checkpoint.format: dcp``): every rank writes its part, in parallel.

Layout in ``runs/<name>/checkpoints/``: one folder per checkpoint, ``step-00000120/``,
written by ``torch.distributed.checkpoint`` (DCP): a ``__R_0.distcp`` file from each rank
that has something to write, then ``.metadata``, which rank 0 writes (to a temporary name,
renamed) only after every rank's files are written and fsync'd. Then rank 0 replaces
``last.dcp`` (and ``best.dcp``), one line naming the folder, and prunes to ``keep_last``.

A folder counts only when complete: its metadata reads, and every file the metadata names
is there at its full size. A folder without metadata is an interrupted write: skipped
(and kept; the run writes that step again). One whose metadata or files are broken is
refused in one line and kept, and an older one is used.

What a checkpoint holds:
- modules and optimizers through ``get_model_state_dict``/``get_optimizer_state_dict``:
  sharded under FSDP2 (each rank writes its shards); DDP's replicated tensors are dealt
  out over the ranks by DCP's de-duplication, so every rank writes a part either way;
- ``ddp_hpc.shared``: the plain data that is the same on every rank (step, progress, data
  order, schedulers, extras), one blob of fixed size that rank 0 writes;
- ``ddp_hpc.rank.NNNNN``: each rank's own state (its RNG streams), in that rank's file.
Nothing that grows with the world size passes through rank 0 beyond DCP's own save plan
(a few entries per rank). A different world size reshards the modules and optimizers
(DCP) and leaves the per-rank parts unread.

Reading a folder (naming, completeness, weights-only reads) is ``dcp_read.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ddp_hpc.contract import (BEST_SHARDED_CHECKPOINT, LAST_SHARDED_CHECKPOINT, SHARDED_METADATA_FILE,
                              atomic_write, fsync_directory)
from ddp_hpc.engine.checkpoint.background_writer import CheckpointWriteError, WriteRecord
from ddp_hpc.engine.checkpoint.dcp_read import (PARAM_GROUPS_KEY, SHARED_KEY, blob_template, check_complete,
                                                from_blob, load_tensors, newest_complete, pointed_at, quiet_single_process,
                                                rank_key, read_blob, sharded_checkpoints, step_dir, step_of, to_blob)
from ddp_hpc.engine.checkpoint.files import CheckpointError
from ddp_hpc.engine.group import Collectives
from ddp_hpc.engine.checkpoint.host_copy import snapshot
from ddp_hpc.torch_support import dcp_async_takes_stager, dcp_takes_no_dist

log = logging.getLogger(__name__)

def _lowest_rank_planner() -> DefaultSavePlanner:
    """DCP's planner, keeping rank 0's copy of what every rank holds. DCP takes a tensor
    every rank has under one name for the same on each and writes one rank's, spreading the
    writes over the ranks; a DDP model's buffers (BatchNorm's running statistics) are not
    the same: each rank updates its own in its forward, and DDP broadcasts rank 0's at the
    next. Rank 0's are the model's: a restore that gave rank 0 another rank's would train
    on from other statistics."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


class _HostStager(AsyncStager):
    """``dcp.async_save``'s staging (torch's ``AsyncStager`` protocol): this rank's part
    copied into host buffers kept from one save to the next (``host_copy.snapshot``: pinned
    from CUDA, FSDP2's DTensors kept DTensors), complete when ``stage`` returns. One
    instance serves every save: the next save refills the buffers only after the previous
    write is done (``DcpFormat.save`` waits for it first). Not torch's ``DefaultStager``
    kept between saves: from torch 2.11 its stage ends by ``close()``-ing the copier it
    reuses, and the second save fails (``KeyError: <class 'type'>``); and it made (and
    page-faulted) a new host copy per save anyway."""

    _synchronize_after_execute = False  # stage() returns a finished copy: nothing to wait for

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return snapshot(state_dict, self._buffers)

    def synchronize_staging(self) -> None:
        """Nothing: ``stage`` returns once the copy is complete."""

    def close(self) -> None:
        self._buffers.clear()


# ----- what is saved ------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardedState:
    """A checkpoint's parts: live modules and optimizers (each with the module whose
    parameters it steps), the plain data all ranks share, and this rank's own."""

    modules: Mapping[str, nn.Module]
    optimizers: Mapping[str, tuple[nn.Module, torch.optim.Optimizer]] = field(default_factory=dict)
    shared: Mapping[str, Any] = field(default_factory=dict)
    per_rank: Mapping[str, Any] = field(default_factory=dict)


def _tensor_state(state: ShardedState) -> dict[str, Any]:
    options = StateDictOptions()
    out: dict[str, Any] = {name: get_model_state_dict(module, options=options)
                           for name, module in state.modules.items()}
    for name, (module, optimizer) in state.optimizers.items():
        if hasattr(optimizer, "consolidate_state_dict"):
            raise CheckpointError("checkpoint.format dcp cannot save a ZeroRedundancyOptimizer: "
                                  "use checkpoint.format=file, or FSDP2 instead of ZeRO")
        out[name] = get_optimizer_state_dict(module, optimizer, options=options)
    return out


def _param_group_settings(state: ShardedState) -> dict[str, list[dict[str, Any]]]:
    return {name: [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            for name, (_, optimizer) in state.optimizers.items()}


def _check_matches(path: Path, metadata: Metadata, template: Mapping[str, Any]) -> None:
    """Refuse, in one line, a checkpoint of other objects or another model's shapes."""
    saved = metadata.state_dict_metadata
    for name, part in template.items():
        if not isinstance(part, Mapping):
            continue
        keys = [k for k, v in _flat(part, name) if isinstance(v, torch.Tensor)]
        missing = [k for k in keys if k not in saved]
        if missing:
            raise CheckpointError(f"checkpoint {path} is from a different model: missing "
                                  f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        for key, value in _flat(part, name):
            entry = saved.get(key)
            if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata) \
                    and tuple(entry.size) != tuple(value.shape):
                raise CheckpointError(f"checkpoint {path} is from a different model: {key} has shape "
                                      f"{list(entry.size)} there but {list(value.shape)} here")


def _flat(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [item for k, v in value.items() for item in _flat(v, f"{prefix}.{k}")]
    return [(prefix, value)]


@dataclass(frozen=True)
class Restored:
    """What ``DcpFormat.load`` read: where from, the shared data, this rank's own part
    (empty when the checkpoint is of another world size)."""

    path: Path
    shared: dict[str, Any]
    mine: dict[str, Any]


# ----- the format ---------------------------------------------------------------------------

class DcpFormat:
    """Writes and reads sharded checkpoint folders. Every rank calls every method.

    ``background``: ``dcp.async_save``: training waits for a copy of its part to host
    memory, then a thread writes it, on a process group of its own (gloo) so that its
    collectives never interleave with training's. At most one write is in flight.
    """

    def __init__(self, *, background: bool = False) -> None:
        self.background = background
        self._pending: threading.Event | None = None
        self._pending_path: Path | None = None
        self._group: Any = None
        self._stager: _HostStager | None = None
        self._finished: list[WriteRecord] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        #: The last save's time training was blocked (the benchmark reports it).
        self.last_stall_s = 0.0

    # --- saving ---

    def save(self, group: Collectives, directory: Path, step: int, state: ShardedState, *,
             keep_last: int, best: bool = False) -> Path:
        self._wait_pending()
        started = time.perf_counter()
        path = step_dir(directory, step)
        if group.is_rank_zero:
            directory.mkdir(parents=True, exist_ok=True)
            self._set_aside(path)
        group.barrier()  # no rank writes into the folder before it is free
        to_save = _tensor_state(state)
        if group.is_rank_zero:
            to_save[SHARED_KEY] = to_blob({**state.shared, PARAM_GROUPS_KEY: _param_group_settings(state)})
        to_save[rank_key(group.rank)] = to_blob(dict(state.per_rank))
        no_dist = not group.group_initialized
        commit = _Commit(directory, path, keep_last, best, group.is_rank_zero, started)
        if self.background:
            if dcp_async_takes_stager(torch.__version__):
                options = {"no_dist": no_dist, "async_stager": self._host_stager()}
            else:
                # Before torch 2.9 async_save stages without a stager of ours, and on 2.5 a
                # resume from what it wrote was not the state at the save (seen on CPU): it
                # gets a copy of its own, taken here, before training goes on.
                options, to_save = {}, snapshot(to_save)
            with quiet_single_process(no_dist):
                response = dcp.async_save(to_save, checkpoint_id=path, process_group=self._writer_group(no_dist),
                                          planner=_lowest_rank_planner(), **options)
            future = getattr(response, "upload_completion", response)
            committed = threading.Event()
            self._pending, self._pending_path = committed, path
            future.add_done_callback(lambda done: self._committed(done, commit, committed))
        else:
            with quiet_single_process(no_dist):
                # Before torch 2.7 save() takes no no_dist: it works out the same from the default group.
                dcp.save(to_save, checkpoint_id=path, planner=_lowest_rank_planner(),
                         **({"no_dist": no_dist} if dcp_takes_no_dist(torch.__version__) else {}))
            record = commit()
            group.barrier()  # returns on every rank once last.dcp names the new folder
            self._finished.append(record)
        self.last_stall_s = time.perf_counter() - started
        return path

    def _writer_group(self, no_dist: bool) -> Any:
        if no_dist:
            return None
        if self._group is None:  # a collective: every rank creates it at the same save
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _host_stager(self) -> _HostStager:
        if self._stager is None:
            self._stager = _HostStager()
        return self._stager

    def _committed(self, done: Future, commit: _Commit, committed: threading.Event) -> None:
        try:
            done.result()
            record = commit()
        except BaseException as exc:  # handed to the training thread by wait()
            with self._lock:
                self._error = exc
        else:
            with self._lock:
                self._finished.append(record)
        finally:
            committed.set()

    @staticmethod
    def _set_aside(path: Path) -> None:
        """A complete folder of this very step (a second save of one step) is moved aside
        while the new one is written: rewritten in place, a kill would leave neither."""
        if (path / SHARDED_METADATA_FILE).exists():
            os.replace(path, path.with_name(f".{path.name}.replaced-{os.getpid()}"))
            fsync_directory(path.parent)

    def _wait_pending(self) -> None:
        """This rank's write (and rank 0's commit) done; its error raised here. No collective."""
        if self._pending is not None:
            self._pending.wait()  # set once the write and rank 0's commit are done
            self._pending = None
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointWriteError(f"background write of checkpoint {self._pending_path} failed: "
                                       f"{type(error).__name__}: {error}") from error

    def take_finished(self) -> list[WriteRecord]:
        """The writes finished since the last call (without waiting)."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self) -> list[WriteRecord]:
        """Block until no write is in flight; the writes finished since the last call."""
        self._wait_pending()
        return self.take_finished()

    # --- reading ---

    def newest(self, group: Collectives, directory: Path) -> Path | None:
        """The newest complete checkpoint folder, the same on every rank (or None)."""
        found = newest_complete(directory, report=group.is_rank_zero)
        step = step_of(found[0]) if found else -1
        if group.group_initialized:
            high, negative_low = group.all_reduce([float(step), -float(step)], "max")
            low = -negative_low
            if low != high:
                raise CheckpointError(f"the ranks see different newest checkpoints in {directory} (steps "
                                      f"{int(low)} and {int(high)}): is the folder on a file system all nodes share?")
        return found[0] if found else None

    def load(self, group: Collectives, path: Path, state: ShardedState) -> Restored:
        """Load ``path`` into the modules and optimizers; the shared data and this rank's part."""
        metadata = check_complete(path)
        shared = read_blob(path, metadata, SHARED_KEY)
        if not isinstance(shared, dict):
            raise CheckpointError(f"checkpoint {path} is not a ddp_hpc checkpoint")
        template = _tensor_state(state)
        _check_matches(path, metadata, template)
        key = rank_key(group.rank)
        same_world = int(shared.get("world_size", -1)) == group.world_size
        if same_world and key in metadata.state_dict_metadata:
            template[key] = blob_template(metadata, key)
        try:
            with quiet_single_process(not group.group_initialized):
                load_tensors(template, path, no_dist=not group.group_initialized)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - DCP wraps a rank's failure in its own exception
            raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''})") from None
        options = StateDictOptions()
        for name, module in state.modules.items():
            set_model_state_dict(module, template[name], options=options)
        settings = shared.pop(PARAM_GROUPS_KEY, None) or {}
        for name, (module, optimizer) in state.optimizers.items():
            set_optimizer_state_dict(module, optimizer, template[name], options=options)
            saved = settings.get(name)
            if saved is not None and len(saved) == len(optimizer.param_groups):
                for group, values in zip(optimizer.param_groups, saved):
                    group.update(values)
        mine = from_blob(template[key], f"{path} ({key})") if key in template else {}
        return Restored(path, shared, mine)


@dataclass(frozen=True)
class _Commit:
    """Rank 0's part once a checkpoint's metadata is written: pointers, then pruning."""

    directory: Path
    path: Path
    keep_last: int
    best: bool
    is_rank_zero: bool
    started: float

    def __call__(self) -> WriteRecord:
        if self.is_rank_zero:
            fsync_directory(self.path)
            atomic_write(self.directory / LAST_SHARDED_CHECKPOINT, f"{self.path.name}\n", durable=True)
            if self.best:
                atomic_write(self.directory / BEST_SHARDED_CHECKPOINT, f"{self.path.name}\n", durable=True)
            for aside in self.directory.glob(f".{self.path.name}.replaced-*"):
                shutil.rmtree(aside, ignore_errors=True)
            prune(self.directory, self.keep_last)
        return WriteRecord(self.path, 0.0, time.perf_counter() - self.started)


def prune(directory: Path, keep_last: int) -> None:
    """Delete complete folders beyond the newest ``keep_last`` complete ones, except those
    ``last.dcp``/``best.dcp`` name. Incomplete folders are left: they are reported, not deleted."""
    complete = [p for p in sharded_checkpoints(directory) if (p / SHARDED_METADATA_FILE).exists()]
    keep = {pointed_at(directory, LAST_SHARDED_CHECKPOINT), pointed_at(directory, BEST_SHARDED_CHECKPOINT)}
    for old in complete[:-keep_last]:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)

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

Reading is weights-only: the metadata through a restricted unpickler, plain values with
``torch.load(weights_only=True)`` (DCP's own reader unpickles both without restriction).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ddp_hpc.contract import (BEST_SHARDED_CHECKPOINT, LAST_SHARDED_CHECKPOINT, SHARDED_METADATA_FILE,
                              SHARDED_STEP_FOLDER, atomic_write, fsync_directory)
from ddp_hpc.engine.checkpoint.background_writer import CheckpointWriteError, WriteRecord
from ddp_hpc.engine.checkpoint.files import CheckpointError
from ddp_hpc.engine.group import Collectives
from ddp_hpc.engine.checkpoint.host_copy import snapshot
from ddp_hpc.torch_support import dcp_async_takes_stager, dcp_takes_no_dist

log = logging.getLogger(__name__)

SHARED_KEY = "ddp_hpc.shared"
#: In the shared data: each optimizer's param-group settings (all but ``params``), as a
#: single-file checkpoint keeps them. ``set_optimizer_state_dict`` fills only the settings
#: the live optimizer already has, so one an LR scheduler adds (``initial_lr``, OneCycleLR's
#: ``max_lr``/``min_lr``) would be lost for a scheduler planned after the restore.
PARAM_GROUPS_KEY = "ddp_hpc.param_groups"


@contextmanager
def _quiet(single_process: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process: it is one."""
    with warnings.catch_warnings():
        if single_process:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def rank_key(rank: int) -> str:
    return f"ddp_hpc.rank.{rank:05d}"


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def step_of(path: Path) -> int:
    match = SHARDED_STEP_FOLDER.match(path.name)
    if not match:
        raise CheckpointError(f"{path} is not a sharded checkpoint folder (step-NNNNNNNN)")
    return int(match.group(1))


def sharded_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders, complete or not, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if SHARDED_STEP_FOLDER.match(p.name) and p.is_dir())


ACCEPTED_FORMS = f"a step-NNNNNNNN folder, a file in one, or {LAST_SHARDED_CHECKPOINT} / {BEST_SHARDED_CHECKPOINT}"


def named_checkpoint(path: Path) -> Path:
    """The checkpoint folder a user names, as they would type it: the folder itself, a
    file in it (``.metadata``, a shard), or ``last.dcp``/``best.dcp`` (the folder that
    pointer names). A ``CheckpointError`` in one line for anything else."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file() and path.suffix == ".dcp":  # last.dcp, best.dcp, or a copy of one
        target = pointed_at(path.parent, path.name)
        if target is None:
            raise CheckpointError(f"{path} names no checkpoint folder (it should hold one line, step-NNNNNNNN)")
        return target
    if path.is_file() and SHARDED_STEP_FOLDER.match(path.parent.name):
        return path.parent
    if path.is_dir() and (SHARDED_STEP_FOLDER.match(path.name) or (path / SHARDED_METADATA_FILE).exists()):
        return path
    if path.is_file() and path.suffix == ".pt":
        raise CheckpointError(f"checkpoint {path} is a single file (checkpoint.format=file), and this run reads "
                              "format dcp: resume it with checkpoint.format=file")
    raise CheckpointError(f"{path} is not a sharded checkpoint: name {ACCEPTED_FORMS}")


# ----- reading, weights-only ------------------------------------------------------------

_METADATA_CLASSES = {
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch dtypes and sizes: nothing that runs code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _WeightsOnlyReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(Path(self.path))


def _load_bytes_weights_only(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    loaded = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, with plain values read by ``torch.load(weights_only=True)``."""

    load_bytes = _load_bytes_weights_only


class _WholeLoadPlanner(_EmptyStateDictLoadPlanner):
    """Everything a checkpoint holds (or its ``keys``), weights-only, into an empty dict."""

    load_bytes = _load_bytes_weights_only


def read_metadata(path: Path) -> Metadata:
    """The checkpoint folder's metadata; a ``CheckpointError`` when absent or unreadable."""
    file = path / SHARDED_METADATA_FILE
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {file.name} (its write "
                              "was interrupted)") from None
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError, ImportError,
            IndexError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable: {file.name} is corrupt "
                              f"({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path} is unreadable: {file.name} holds no DCP metadata")
    return metadata


def check_complete(path: Path) -> Metadata:
    """The metadata of a complete checkpoint folder: every file it names there at full size."""
    metadata = read_metadata(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing") from None
        if actual < size:
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} has {actual} of its {size} bytes")
    if SHARED_KEY not in metadata.state_dict_metadata:
        raise CheckpointError(f"checkpoint {path} is not a ddp_hpc checkpoint (no {SHARED_KEY})")
    return metadata


def newest_complete(directory: Path, *, report: bool = True) -> tuple[Path, Metadata] | None:
    """The newest complete checkpoint folder. Folders without metadata (interrupted writes)
    are skipped; when there are broken ones and no complete one, a ``CheckpointError``
    (starting over would throw the run away: the user decides). Nothing is deleted."""
    broken: list[CheckpointError] = []
    for path in reversed(sharded_checkpoints(directory)):
        if not (path / SHARDED_METADATA_FILE).exists():
            if report:
                log.info("skipping %s: its write was interrupted (no %s)", path, SHARDED_METADATA_FILE)
            continue
        try:
            metadata = check_complete(path)
        except CheckpointError as exc:
            broken.append(exc)
            continue
        if report:
            for exc in broken:
                log.warning("%s; using an older one", exc)
        return path, metadata
    if broken:
        raise CheckpointError(f"none of the sharded checkpoints in {directory} can be read ({broken[0]}"
                              f"{f' and {len(broken) - 1} more' if len(broken) > 1 else ''}); nothing was "
                              "deleted: restore them, or start over with checkpoint.resume=never")
    return None


def _lowest_rank_planner() -> DefaultSavePlanner:
    """DCP's planner, keeping rank 0's copy of what every rank holds. DCP takes a tensor
    every rank has under one name for the same on each and writes one rank's, spreading the
    writes over the ranks; a DDP model's buffers (BatchNorm's running statistics) are not
    the same: each rank updates its own in its forward, and DDP broadcasts rank 0's at the
    next. Rank 0's are the model's: a restore that gave rank 0 another rank's would train
    on from other statistics."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def _blob(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unblob(tensor: torch.Tensor, source: str) -> Any:
    try:
        return torch.load(io.BytesIO(tensor.numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the same refusal
        raise CheckpointError(f"checkpoint {source} is unreadable ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None


def _blob_template(metadata: Metadata, key: str) -> torch.Tensor:
    entry = metadata.state_dict_metadata[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint entry {key} is not a blob")
    return torch.empty(tuple(entry.size), dtype=torch.uint8)


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


def _load_tensors(template: dict[str, Any], path: Path, *, no_dist: bool) -> None:
    """Read ``path`` into ``template``'s tensors (plain tensors, no ``Stateful`` objects), as
    the weights-only reader allows; ``no_dist``: this process alone, no collectives."""
    reader, planner = _WeightsOnlyReader(path), _WeightsOnlyLoadPlanner(allow_partial_load=True)
    if dcp_takes_no_dist(torch.__version__):
        dcp.load(template, storage_reader=reader, planner=planner, no_dist=no_dist)
    else:  # before torch 2.7 only the loader under load() takes no_dist; for plain tensors it is the same call
        _load_state_dict(template, storage_reader=reader, planner=planner, no_dist=no_dist)


def read_blob(path: Path, metadata: Metadata, key: str) -> Any:
    """One blob (``ddp_hpc.shared`` or a rank's), read by this process alone (no collectives)."""
    template = {key: _blob_template(metadata, key)}
    try:
        with _quiet(True):
            _load_tensors(template, path, no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a shard file that does not read
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    return _unblob(template[key], f"{path} ({key})")


def read_whole(path: Path) -> dict[str, Any]:
    """A complete checkpoint folder as one nested dict, as a single-file checkpoint holds it
    (the shared data, the other objects' state, the modules' and optimizers' full tensors;
    no per-rank parts), read by this process alone: for ``ddp-hpc checkpoint convert``,
    inspection and tests. It needs the memory of the whole state."""
    metadata = check_complete(path)
    shared = read_blob(path, metadata, SHARED_KEY)
    tops = {(metadata.planner_data or {}).get(key, (key,))[0] for key in metadata.state_dict_metadata}
    keys = sorted(str(top) for top in tops if not str(top).startswith(("ddp_hpc.",)))
    whole: dict[str, Any] = {}
    if keys:
        try:
            with _quiet(True):
                # The private loader, as torch's own dcp_to_torch_save does: the public one
                # copies the (empty) dict it is given and would fill the copy.
                _load_state_dict(whole, storage_reader=_WeightsOnlyReader(path), planner=_WholeLoadPlanner(keys=keys),
                                 no_dist=True)
        except Exception as exc:  # noqa: BLE001 - a shard file that does not read
            raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''})") from None
    shared.pop(PARAM_GROUPS_KEY, None)
    objects = shared.pop("objects", None) or {}
    return {**shared, **objects, **whole}


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
            to_save[SHARED_KEY] = _blob({**state.shared, PARAM_GROUPS_KEY: _param_group_settings(state)})
        to_save[rank_key(group.rank)] = _blob(dict(state.per_rank))
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
            with _quiet(no_dist):
                response = dcp.async_save(to_save, checkpoint_id=path, process_group=self._writer_group(no_dist),
                                          planner=_lowest_rank_planner(), **options)
            future = getattr(response, "upload_completion", response)
            committed = threading.Event()
            self._pending, self._pending_path = committed, path
            future.add_done_callback(lambda done: self._committed(done, commit, committed))
        else:
            with _quiet(no_dist):
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
            template[key] = _blob_template(metadata, key)
        try:
            with _quiet(not group.group_initialized):
                _load_tensors(template, path, no_dist=not group.group_initialized)
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
        mine = _unblob(template[key], f"{path} ({key})") if key in template else {}
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


def pointed_at(directory: Path, pointer: str) -> Path | None:
    try:
        name = (directory / pointer).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return directory / name if SHARDED_STEP_FOLDER.match(name) else None


def prune(directory: Path, keep_last: int) -> None:
    """Delete complete folders beyond the newest ``keep_last`` complete ones, except those
    ``last.dcp``/``best.dcp`` name. Incomplete folders are left: they are reported, not deleted."""
    complete = [p for p in sharded_checkpoints(directory) if (p / SHARDED_METADATA_FILE).exists()]
    keep = {pointed_at(directory, LAST_SHARDED_CHECKPOINT), pointed_at(directory, BEST_SHARDED_CHECKPOINT)}
    for old in complete[:-keep_last]:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)

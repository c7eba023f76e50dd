"""Reading sharded checkpoints (``checkpoint.format: dcp``): the folder a user names, whether
a folder is complete, the newest complete one, and weights-only reads of its parts by one
process (``checkpoint inspect``/``convert``, a restore's shared data). Writing and the
restore into live modules are ``dcp_format.py``.

Reading is weights-only: the metadata through a restricted unpickler, plain values with
``torch.load(weights_only=True)`` (DCP's own reader unpickles both without restriction).
"""

from __future__ import annotations

import io
import logging
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ddp_hpc.contract import (BEST_SHARDED_CHECKPOINT, LAST_SHARDED_CHECKPOINT, SHARDED_METADATA_FILE,
                              SHARDED_STEP_FOLDER)
from ddp_hpc.engine.checkpoint.files import CheckpointError
from ddp_hpc.torch_support import dcp_takes_no_dist

log = logging.getLogger(__name__)

SHARED_KEY = "ddp_hpc.shared"
#: In the shared data: each optimizer's param-group settings (all but ``params``), as a
#: single-file checkpoint keeps them. ``set_optimizer_state_dict`` fills only the settings
#: the live optimizer already has, so one an LR scheduler adds (``initial_lr``, OneCycleLR's
#: ``max_lr``/``min_lr``) would be lost for a scheduler planned after the restore.
PARAM_GROUPS_KEY = "ddp_hpc.param_groups"


@contextmanager
def quiet_single_process(single_process: bool) -> Iterator[None]:
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


def to_blob(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_blob(tensor: torch.Tensor, source: str) -> Any:
    try:
        return torch.load(io.BytesIO(tensor.numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the same refusal
        raise CheckpointError(f"checkpoint {source} is unreadable ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None


def blob_template(metadata: Metadata, key: str) -> torch.Tensor:
    entry = metadata.state_dict_metadata[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint entry {key} is not a blob")
    return torch.empty(tuple(entry.size), dtype=torch.uint8)


def load_tensors(template: dict[str, Any], path: Path, *, no_dist: bool) -> None:
    """Read ``path`` into ``template``'s tensors (plain tensors, no ``Stateful`` objects), as
    the weights-only reader allows; ``no_dist``: this process alone, no collectives."""
    reader, planner = _WeightsOnlyReader(path), _WeightsOnlyLoadPlanner(allow_partial_load=True)
    if dcp_takes_no_dist(torch.__version__):
        dcp.load(template, storage_reader=reader, planner=planner, no_dist=no_dist)
    else:  # before torch 2.7 only the loader under load() takes no_dist; for plain tensors it is the same call
        _load_state_dict(template, storage_reader=reader, planner=planner, no_dist=no_dist)


def read_blob(path: Path, metadata: Metadata, key: str) -> Any:
    """One blob (``ddp_hpc.shared`` or a rank's), read by this process alone (no collectives)."""
    template = {key: blob_template(metadata, key)}
    try:
        with quiet_single_process(True):
            load_tensors(template, path, no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a shard file that does not read
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    return from_blob(template[key], f"{path} ({key})")


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
            with quiet_single_process(True):
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


def pointed_at(directory: Path, pointer: str) -> Path | None:
    try:
        name = (directory / pointer).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return directory / name if SHARDED_STEP_FOLDER.match(name) else None

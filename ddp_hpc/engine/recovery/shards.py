"""Copies of a sharded model's state outside its rank: snapshots in node-local memory, each
also held by buddy ranks on other hosts.

Under FSDP2 each shard and its optimizer state exist on one rank only, so a lost rank's part
must be kept somewhere else before it is lost. Every ``every`` steps each rank:

1. copies its state (its shards, its optimizer state, its sampler position and the
   Checkpointer's bookkeeping) into host buffers kept from one snapshot to the next
   (``host_copy``): on CPU ranks the only part training waits for; from a GPU the copies
   are queued on a side stream into pinned buffers and training goes on at once (the
   next kernels that write the same tensors wait for the copies on the GPU, not the CPU);
2. then, on a thread of its own: writes the copy, serialized, into node-local memory (a file
   under ``/dev/shm``, which outlives the process, so that a restart in place on the same
   node reads it there), and swaps copies with its buddies over a process group of its own
   (peer to peer, not through rank 0): it sends its copy to the ``replicas - 1`` ranks
   ``distance`` apart after it (``distance`` = ranks per host by default: another host) and
   keeps the copies of the ranks as far before it.

Each rank keeps the three newest steps of its own copy and of each copy it holds. Why three:
the ranks' completed steps differ by at most one (every step has collectives of all), and a
rank swaps a snapshot before it takes the next, so a buddy that took snapshot ``b`` holds the
lost rank's copy of ``b - 1`` for sure, while a survivor may already hold ``b + 1``: ``b - 1``
is the newest step every shard has, and it is among the three newest of every rank.
Node-local memory per rank: ``3 x replicas`` times its snapshot, plus the host buffers (one
more time) while it trains.

Where Gemini (SOSP 2023) keeps checkpoints in the CPU memory of the machine and its peers,
and NVIDIA's resiliency extension replicates local checkpoints to ``replication_jump``-apart
ranks (``CliqueReplicationStrategy``) for a restart, this is read back inside the running
job too (``rank.py``): survivors roll back to the newest step every shard has, a
replacement takes its shards from a buddy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_hpc.contract import SNAPSHOT_DIR_VAR, atomic_write
from ddp_hpc.engine.group import ProcessGroupView
from ddp_hpc.engine.checkpoint.host_copy import Copying, dtensor_class, snapshot_on_side_streams
from ddp_hpc.engine.recovery.fence import wait_for_stream
from ddp_hpc.engine.recovery.layout import DEFAULT_REPLICAS, KEPT_STEPS, Buddies, steps_held  # noqa: F401  (re-exported)
from ddp_hpc.engine.recovery.payload import PIECE_BYTES, pieces, state_to_tensor
from ddp_hpc.startup.group_start import GroupStart

log = logging.getLogger(__name__)

class SnapshotFiles:
    """The snapshots this node holds, one file per slot and step:
    ``<root>/<host>/slot<k>/step<N>.pt``, written atomically (a reader sees a whole copy
    or none)."""

    def __init__(self, root: Path, host: str | None = None) -> None:
        self.root = root
        self.directory = root / (host or socket.gethostname())

    def path(self, slot: int, step: int) -> Path:
        return self.directory / f"slot{slot}" / f"step{step:09d}.pt"

    def write(self, slot: int, step: int, payload: torch.Tensor) -> None:
        path = self.path(slot, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, memoryview(payload.numpy()), durable=False)
        self._prune(slot)

    def read(self, slot: int, step: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.path(slot, step).read_bytes()), dtype=torch.uint8)

    def steps(self, slot: int) -> list[int]:
        return steps_held(self.directory, slot)

    def holdings(self, slots: Iterable[int]) -> dict[int, list[int]]:
        return {slot: steps for slot in slots if (steps := self.steps(slot))}

    def drop_after(self, slot: int, step: int) -> None:
        """Forget the copies of steps after ``step`` (the steps are redone)."""
        for later in self.steps(slot):
            if later > step:
                self.path(slot, later).unlink(missing_ok=True)

    def remove(self, slots: Iterable[int]) -> None:
        for slot in slots:
            shutil.rmtree(self.directory / f"slot{slot}", ignore_errors=True)
        for folder in (self.directory, self.root):
            try:
                folder.rmdir()  # only where nothing else is left in it
            except OSError:
                pass

    def _prune(self, slot: int) -> None:
        for old in self.steps(slot)[:-KEPT_STEPS]:
            self.path(slot, old).unlink(missing_ok=True)


def snapshot_root(run_dir: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    """The folder of this run's snapshots on node-local memory: one per run folder (so that
    a restart in place finds the last attempt's), under ``$DDP_HPC_SNAPSHOT_DIR``, or
    ``/dev/shm`` where the node has it."""
    base = environ.get(SNAPSHOT_DIR_VAR) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    where = os.path.abspath(os.fspath(run_dir) if run_dir is not None else os.getcwd())
    key = hashlib.sha1(where.encode()).hexdigest()[:12]
    return Path(base) / f"ddp_hpc-snapshots-{os.getuid()}-{key}"


# ----- DTensors in and out of a payload -------------------------------------------------

def localized(tree: Any, path: tuple = (), found: list[list] | None = None) -> tuple[Any, list[list]]:
    """``tree`` with each DTensor replaced by its local shard, and the key paths where they
    were (a payload holds plain tensors only: it is read with ``weights_only=True``)."""
    found = [] if found is None else found
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(tree, dtensor):
        found.append(list(path))
        return tree.to_local(), found
    if isinstance(tree, Mapping):
        return {k: localized(v, (*path, k), found)[0] for k, v in tree.items()}, found
    if isinstance(tree, list):
        return [localized(v, (*path, i), found)[0] for i, v in enumerate(tree)], found
    if isinstance(tree, tuple):
        return tuple(localized(v, (*path, i), found)[0] for i, v in enumerate(tree)), found
    return tree, found


def _set_path(tree: Any, path: Sequence[Any], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _get_path(tree: Any, path: Sequence[Any]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def as_dtensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a shard of a DTensor laid out as ``like`` (a live one), on its device."""
    dtensor = dtensor_class()
    assert dtensor is not None
    return dtensor.from_local(local.to(like.to_local().device), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


def restored_dtensors(name: str, state: Any, paths: Iterable[Sequence[Any]], obj: Any) -> Any:
    """``state`` (the object ``name``'s, from a payload) with the DTensors at ``paths`` made
    again from their local shards, laid out as the live ``obj``'s: a module's own tensors,
    or, for an optimizer, the parameter each state entry belongs to."""
    live_module = obj.state_dict() if isinstance(obj, torch.nn.Module) else None
    params = [p for group in obj.param_groups for p in group["params"]] if isinstance(
        obj, torch.optim.Optimizer) else None
    for path in paths:
        if not path or path[0] != name:
            continue
        inner = path[1:]
        if live_module is not None:
            like = live_module[inner[0]]
        elif params is not None and len(inner) >= 2 and inner[0] == "state":
            like = params[int(inner[1])]
        else:
            raise RuntimeError(f"a sharded tensor of {name} at {'/'.join(map(str, inner))} has no live counterpart")
        _set_path(state, inner, as_dtensor(_get_path(state, inner), like))
    return state


# ----- the snapshots of one rank --------------------------------------------------------

@dataclass(frozen=True)
class SwapLink:
    """Where a group's snapshot swaps meet: the launch's store, under a key prefix of that
    group's own (its generation), with the group's rank and size, made as the rank's start-up
    makes its groups."""

    address: str
    prefix: str
    rank: int
    world_size: int
    group_start: GroupStart

    @property
    def timeout_s(self) -> float:
        return self.group_start.timeout.total_seconds()


class Snapshots:
    """Takes this rank's snapshots every ``every`` steps and swaps copies with its buddies.

    ``state``: returns the rank's state to copy (tensors may be DTensors on any device).
    ``files``: where this node keeps copies. ``buddies``: who holds whose.

    The swaps run on a gloo group of their own, which the swapping thread makes itself on
    its first swap for each training group (``attach``): made on the training thread,
    a group whose member died starting would hold training in its rendezvous until the
    timeout, where the training group's next collective fails at once and recovers.
    """

    def __init__(self, every: int, buddies: Buddies, files: SnapshotFiles,
                 state: Callable[[], dict[str, Any]]) -> None:
        self.every, self.buddies, self.files, self._state = every, buddies, files, state
        self._cache: dict[tuple, torch.Tensor] = {}
        #: A side stream per GPU the copies are queued on (the loop goes on meanwhile).
        self._streams: dict[torch.device, Any] = {}
        self._thread: threading.Thread | None = None
        self._link: SwapLink | None = None
        self._group: Any = None
        #: Seconds training waited for the host copy of the newest snapshot.
        self.last_stall_s = 0.0
        #: Bytes of the newest snapshot (this rank's own copy, serialized).
        self.last_bytes = 0

    def attach(self, link: SwapLink) -> None:
        """The group the copies travel over from now on. A swap of the group before, still
        running, is left to fail on its own (its peers' sockets are gone): whatever it still
        writes is a whole copy of its step, which a redone step makes bit for bit again."""
        self._link, self._group, self._thread = link, None, None

    @property
    def slot(self) -> int:
        return self._link.rank if self._link is not None else 0

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def take(self, step: int) -> None:
        """Copy this rank's state of ``step`` to host buffers (training waits for that only),
        then keep and swap it in the background."""
        import time

        self.wait()
        started = time.perf_counter()
        copying = snapshot_on_side_streams(self._state(), self._cache, self._streams)
        self.last_stall_s = time.perf_counter() - started
        self._thread = threading.Thread(target=self._keep, args=(step, copying, self._link), daemon=True,
                                        name="ddp_hpc-snapshot")
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """The background part of the newest snapshot is done (or failed)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None

    def barrier(self) -> None:
        """Every member's swaps are done (a collective of the swap group, where one was made)."""
        self.wait()
        if self._group is not None:
            self._group.barrier().wait()

    def _keep(self, step: int, copying: Copying, link: SwapLink | None) -> None:
        slot = link.rank if link is not None else 0
        try:
            local, paths = localized(copying.wait())
            payload = state_to_tensor({**local, "dtensors": paths})
            self.last_bytes = payload.numel()
            self.files.write(slot, step, payload)
            if link is not None:
                self._swap(step, payload, link)
        except (RuntimeError, OSError, ValueError) as exc:  # a buddy lost meanwhile: the recovery deals with it
            log.warning("rank %d: snapshot of step %d not swapped with its buddies (%s)", slot, step,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def _swap(self, step: int, payload: torch.Tensor, link: SwapLink) -> None:
        from ddp_hpc.engine.recovery.store import connect

        if self._group is None or self._link is not link:
            store = dist.PrefixStore(link.prefix, connect(link.address, link.timeout_s))
            group = link.group_start.gloo_group(store, link.rank, link.world_size)
            if self._link is not link:  # the training group changed meanwhile
                return
            self._group = group
        group = self._group
        sends = []
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for holder in self.buddies.holders(link.rank):
            sends.append(group.send([size], holder, step))
            sends.append(group.send([payload], holder, step))
        for source in self.buddies.held_by(link.rank):
            incoming = torch.zeros(1, dtype=torch.int64)
            group.recv([incoming], source, step).wait()
            copy = torch.empty(int(incoming), dtype=torch.uint8)
            group.recv([copy], source, step).wait()
            self.files.write(source, step, copy)
        for work in sends:
            work.wait()


# ----- the newest step every shard has, and moving copies to where they are needed ------

def gather_json(value: Any, check: Callable[[], None] | None = None) -> list[Any]:
    """``value`` of every rank of the current group, as JSON (no pickle travels), in
    tensors on the group's device (the GPU for nccl). ``check`` is asked after each result
    reaches the host (over NCCL, whether the group was aborted meanwhile)."""
    check = check or (lambda: None)
    device = ProcessGroupView.current().device
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = max(int(size) for size in sizes)
    check()
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(gathered, padded.to(device))
    texts = [bytes(t[:int(size)].cpu().tolist()) for t, size in zip(gathered, sizes, strict=True)]
    check()
    return [json.loads(text.decode()) for text in texts]


@dataclass(frozen=True)
class Rollback:
    """The newest step every slot's copy is found at, and where each slot's is taken from."""

    step: int
    #: slot -> the group rank that has its copy (its own rank where it holds one itself).
    sources: dict[int, int]
    #: Steps done again: from the newest step a member had completed back to ``step``.
    redone: int = 0


def newest_common(holdings: Sequence[Mapping[str, Sequence[int]]]) -> Rollback | None:
    """From each rank's holdings (by group rank: ``{slot: [steps]}``, JSON keys), the newest
    step at which every slot of the group (one per rank) has a copy somewhere; None if none."""
    world = len(holdings)
    where: dict[int, dict[int, list[int]]] = {slot: {} for slot in range(world)}
    for rank, held in enumerate(holdings):
        for slot, steps in held.items():
            if int(slot) in where:
                for step in steps:
                    where[int(slot)].setdefault(int(step), []).append(rank)
    common = set.intersection(*(set(steps) for steps in where.values())) if where else set()
    if not common:
        return None
    step = max(common)
    sources = {slot: (slot if slot in where[slot][step] else min(where[slot][step])) for slot in range(world)}
    return Rollback(step=step, sources=sources)


def fetch_own(rollback: Rollback, files: SnapshotFiles, device: torch.device | None = None,
              check: Callable[[], None] | None = None) -> torch.Tensor:
    """This rank's copy at the rollback step: its own file, or sent by the rank that has it
    (peer to peer, in slot order so that every send meets its receive), in pieces on
    ``device`` (the group's: the GPU for nccl). ``check`` as in ``gather_json``."""
    device = torch.device("cpu") if device is None else device
    check = check or (lambda: None)
    rank = dist.get_rank()
    mine: torch.Tensor | None = None
    for slot in sorted(rollback.sources):
        source = rollback.sources[slot]
        if source == slot:
            continue
        if rank == source:
            payload = files.read(slot, rollback.step)
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), slot)
            for start in pieces(payload.numel()):
                dist.send(payload[start:start + PIECE_BYTES].to(device), slot)
                wait_for_stream(device.type)
        elif rank == slot:
            size = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(size, source)
            total = int(size)
            check()
            mine = torch.empty(total, dtype=torch.uint8)
            for start in pieces(total):
                piece = torch.empty(min(PIECE_BYTES, total - start), dtype=torch.uint8, device=device)
                dist.recv(piece, source)
                mine[start:start + piece.numel()] = piece.cpu()
                check()
    if mine is None:
        mine = files.read(rank, rollback.step)
    return mine


def state_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree`` on this rank (a DTensor's local shard)."""
    dtensor = dtensor_class()
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if dtensor is not None and isinstance(tree, dtensor) else tree
        return local.numel() * local.element_size()
    if isinstance(tree, Mapping):
        return sum(state_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(v) for v in tree)
    return 0


def available_memory_bytes(folder: Path) -> int:
    """What the node can still hold: its available memory, and the free space of the file
    system under ``folder`` (``/dev/shm`` is capped below the memory), whichever is less."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return min(free, available) if available is not None else free


# ----- an FSDP2 model on a new group ----------------------------------------------------

def _fsdp_states(model: torch.nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no model here is sharded by this FSDP2
        return []
    return [module._get_fsdp_state() for module in model.modules() if isinstance(module, FSDPModule)]


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13 may hold several
    if groups is None:
        groups = [state._fsdp_param_group]
    return [group for group in groups if group is not None]


def fsdp_param_groups(model: torch.nn.Module) -> list[Any]:
    """Every FSDP2 parameter group of ``model`` (none where nothing in it is sharded)."""
    return [group for state in _fsdp_states(model) for group in _param_groups(state)]


def rebind(model: torch.nn.Module) -> None:
    """Point ``model``'s FSDP2 state at the process group formed last (the default group).

    A survivor keeps its model object across a recovery, but FSDP2 keeps the group of the
    mesh it was sharded over (``FSDPMeshInfo.shard_process_group``), and the mesh names its
    group: the default group made anew has a name of its own. Both are pointed at the new
    group, whose members and ranks are the old one's (a replaced rank, never a shrink), so
    every shard stays where it was. torchft gets the same through a process group wrapper
    whose inner group it swaps (``ManagedProcessGroup``); here nothing wraps the user's
    group. One-dimensional meshes over the whole world only (``sharding_refusal``)."""
    world = dist.group.WORLD
    assert world is not None
    for state in _fsdp_states(model):
        for param_group in _param_groups(state):
            infos = {id(info): info for info in (param_group.mesh_info, param_group.post_forward_mesh_info)
                     if info is not None}
            for info in infos.values():
                mesh = info.mesh
                if getattr(mesh, "_dim_group_names", None) is not None:
                    mesh._dim_group_names = [world.group_name]
                registry = getattr(mesh, "_pg_registry", None)
                if registry is not None:
                    registry.clear()
                    registry[world.group_name] = world
                info.shard_process_group = world
                if getattr(info, "reduce_scatter_process_group", None) is not None:
                    info.reduce_scatter_process_group = None


def reset_after_failure(model: torch.nn.Module) -> None:
    """FSDP2's state of the step a lost peer broke, cleared: parameters sharded again, no
    all-gather or reduce-scatter pending, every module idle, so that the next forward starts
    afresh. The step's gradients are lost; it is done again. torch 2.13's
    ``reset_iter_state`` is made for this after a failed step, but it waits on the step's
    pending work, which a broken group may hold until its timeout: the same flags are
    cleared here without waiting (the group is gone; nothing of its work is used). The
    step's gradients are cleared by ``broken_step.clear_broken_step``, after this."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for state in _fsdp_states(model):
        state._training_state = TrainingState.IDLE
        if hasattr(state, "_modules_to_run_forward"):
            state._modules_to_run_forward.clear()
        context = state._state_ctx
        context.iter_forward_root = None
        context.post_backward_final_callback_queued = False
        comm = state._comm_ctx
        if hasattr(comm, "all_gather_state"):
            comm.all_gather_state = None
        if hasattr(comm, "reduce_scatter_state"):
            comm.reduce_scatter_state = None
        for name in ("reduce_scatter_states", "post_forward_order", "_last_post_reduce_events"):
            if hasattr(comm, name):
                getattr(comm, name).clear()
        for param_group in _param_groups(state):
            param_group._training_state = TrainingState.IDLE
            for name in ("_all_gather_result", "_post_reduce_event", "_all_reduce_state",
                         "_reshard_after_forward_event", "_partial_reduce_output"):
                if hasattr(param_group, name):
                    setattr(param_group, name, None)
            param_group._to_sharded()


def sharding_refusal(model: torch.nn.Module) -> str | None:
    """Why the snapshots cannot recover ``model`` (one line), or None: a mesh of one
    dimension over every rank, as ``fully_shard`` makes by default, is what ``rebind`` knows."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return (f"in-job recovery of an FSDP2 model needs torch >= 2.6 (this is {torch.__version__}); use "
                "--max-restarts")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            param_group = getattr(state, "_fsdp_param_group", None)
            if param_group is None:
                continue
            mesh = param_group.mesh_info.mesh
            if mesh.ndim != 1 or mesh.size() != dist.get_world_size():
                return ("in-job recovery of an FSDP2 model covers a mesh of one dimension over every rank (HSDP "
                        "and 2-D meshes are not rebuilt on a new group); use --max-restarts")
    return None

"""The process group: resolve the rank environment, pick the device, init, always tear down.

``process_group()`` yields a ``DistContext`` that carries what the rest of the code needs
(rank, sizes, device) and the few collectives it uses on plain Python values. With one
process no group is created and the helpers work locally, so the same code runs
unchanged on a laptop.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from ddp_hpc.contract import BACKEND_VAR, DEVICE_VAR, RECOVERY_SPARE_VAR, RENDEZVOUS_TIMEOUT_VAR
from ddp_hpc.device import DeviceChoice, requested, select_device
from ddp_hpc.environment import DistEnv, PortRange, resolve_env
from ddp_hpc.environment.fabric import check_fabric, this_host, where_label
from ddp_hpc.environment.jobs import job_hosts
from ddp_hpc.environment.netcheck import NetworkPlan, check_network
from ddp_hpc.errors import UserError
from ddp_hpc.startup.group_start import GroupStart
from ddp_hpc.startup.rendezvous import Rendezvous, handshake, job_identity, parse_timeout
from ddp_hpc.torch_support import installed, libuv_takes_listen_fd, unsupported

log = logging.getLogger(__name__)

T = TypeVar("T")
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
#: The store's own timeout outlasts the handshake's time limit by this much, so that the
#: handshake's one-line message is what a user sees, not the store's C++ error.
STORE_GRACE_S = 30.0


@dataclass(frozen=True)
class DistributedOptions:
    """How to start the process group (the ``distributed`` section of a config)."""

    #: Explicit choices (CLI flags); the environment variables come next, then config_*.
    device: str | None = None
    backend: str | None = None
    config_device: str | None = None
    config_backend: str | None = None
    timeout_s: float = 600.0
    #: Connect to rank 0's store and meet every rank within this; $DDP_HPC_RENDEZVOUS_TIMEOUT wins.
    rendezvous_timeout_s: float = 180.0
    host_suffix: str | None = None
    port_range: PortRange = field(default_factory=PortRange)
    #: Create a group even for one process (collectives then run for real; tests use it).
    init_single_process: bool = False

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise UserError(f"distributed.timeout_s={self.timeout_s} must be > 0")
        if self.rendezvous_timeout_s <= 0:
            raise UserError(f"distributed.rendezvous_timeout_s={self.rendezvous_timeout_s} must be > 0")


class GroupKeeper(Protocol):
    """What started this rank's group in place of the rendezvous (``GroupStarter``), and
    keeps it: ``close`` ends it."""

    def close(self) -> None: ...


#: Starts this rank's group in place of the rendezvous, with the settings every group of
#: this rank is initialised with (``GroupStart``: backend, timeout, device, network); in-job
#: recovery's ``InJobRecovery`` is one (it forms its groups on the store of ``ddp-hpc launch
#: --recover``). ``startup`` never imports the engine: the caller hands the starter in.
GroupStarter = Callable[[GroupStart], GroupKeeper]


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the job and its device, with collectives on Python values."""

    env: DistEnv
    device: DeviceChoice
    group_initialized: bool
    #: What ``process_group(start=...)`` started the group with (None: the rendezvous).
    keeper: GroupKeeper | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def local_world_size(self) -> int:
        return self.env.local_world_size

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def is_rank_zero(self) -> bool:
        return self.env.rank == 0

    @property
    def torch_device(self) -> torch.device:
        """The device this rank computes on (``cuda:N``, ``xpu:N`` or ``cpu``)."""
        return self.device.torch_device

    @property
    def backend(self) -> str:
        return self.device.backend

    def print0(self, *values: object) -> None:
        """``print`` on rank 0 only, flushed (several ranks share the launcher's output)."""
        if self.is_rank_zero:
            print(*values, flush=True)

    def barrier(self) -> None:
        if self.group_initialized:
            dist.barrier()

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Reduce a few numbers over all ranks; ``op`` is sum, mean, max or min.

        Sums run in float64 so counts and totals stay exact well beyond 2**24.
        """
        if op not in (*REDUCE_OPS, "mean"):
            raise ValueError(f"unknown reduce op {op!r}")
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device.torch_device)
        if self.group_initialized:
            dist.all_reduce(tensor, op=REDUCE_OPS["sum" if op == "mean" else op])
        if op == "mean":
            tensor /= self.world_size
        return tensor.cpu().tolist()

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` on every rank (small picklable values only)."""
        if not self.group_initialized:
            return obj
        holder: list[Any] = [obj]
        dist.broadcast_object_list(holder, src=src, device=self._object_device)
        return holder[0]

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order (small picklable values only)."""
        if not self.group_initialized:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None:
        """Every rank's ``obj`` in rank order on rank ``dst``, None elsewhere: what only one
        rank needs, without sending every rank everybody's copy."""
        if not self.group_initialized:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    @contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. to prepare files); the others then follow."""
        if not self.is_rank_zero:
            self.barrier()
        yield
        if self.is_rank_zero:
            self.barrier()

    @property
    def _object_device(self) -> torch.device | None:
        return self.device.torch_device if self.device.index is not None else None


def bind_listener(addr: str, port: int) -> socket.socket | None:
    """A socket bound to ``addr:port`` alone, for rank 0's store; None if ``addr`` is not local.

    torch's TCPStore would listen on every interface; binding the master address itself
    keeps the rendezvous on the network the job uses (loopback on a single node).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UserError(f"master address {addr!r} does not resolve: {exc.strerror}") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"rendezvous port {port} on {addr} is already in use: set MASTER_PORT to a free "
                            "port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            # Rank 0 serves the store, so the master address must be one of its own: the
            # other ranks would otherwise wait at an address where nothing will listen.
            raise UserError(f"master address {addr} is not an address of rank 0's host {socket.gethostname()}: "
                            "set MASTER_ADDR to rank 0's host") from None
        log.warning("cannot bind the rendezvous to %s (%s): listening on all interfaces instead", addr,
                    exc.strerror)
        return None
    return listener


#: Store connections rank 0 serves per rank: the handshake's client (kept by the process
#: group) and the heartbeat's own (liveness.Heartbeat); plus descriptors for everything else.
STORE_CONNECTIONS_PER_RANK = 2
OTHER_DESCRIPTORS = 256


def descriptor_shortfall(world_size: int) -> str | None:
    """Why rank 0 may run out of file descriptors serving ``world_size`` ranks, or None."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = STORE_CONNECTIONS_PER_RANK * world_size + OTHER_DESCRIPTORS
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    return (f"rank 0 serves the rendezvous store to {world_size} ranks ({STORE_CONNECTIONS_PER_RANK} connections "
            f"each) but may open only {soft} files (ulimit -n): raise it to at least {needed} in the job script")


def create_store(dist_env: DistEnv, timeout: timedelta, environ: Mapping[str, str],
                 rendezvous_timeout_s: float | None = None) -> dist.Store:
    """The rendezvous store: rank 0 serves it on the master address, the others connect;
    connect and handshake (``ddp_hpc.startup.rendezvous``) end within ``rendezvous_timeout_s``.

    Under torchrun the agent already serves it (TORCHELASTIC_USE_AGENT_STORE): every rank
    is a client then, under a prefix per restart as torch's own env:// rendezvous uses,
    so that a restarted attempt does not read the keys of the one before.
    """
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    serve = dist_env.rank == 0 and not agent_store
    listener = bind_listener(dist_env.master_addr, dist_env.master_port) if serve else None
    shortfall = descriptor_shortfall(dist_env.world_size) if serve else None
    if shortfall:
        log.warning("%s", shortfall)
    seconds = rendezvous_timeout_s or timeout.total_seconds()
    # An older torch's libuv server cannot take the socket bound above; its legacy one can.
    legacy = {"use_libuv": False} if listener is not None and not libuv_takes_listen_fd(installed()) else {}

    def connect() -> dist.Store:
        store = dist.TCPStore(dist_env.master_addr, dist_env.master_port, dist_env.world_size, is_master=serve,
                              timeout=timedelta(seconds=seconds + STORE_GRACE_S), wait_for_workers=False,
                              master_listen_fd=listener.fileno() if listener else None, **legacy)
        if listener is not None:
            listener.detach()  # the store's server owns the socket now
        if agent_store:
            return dist.PrefixStore(f"/worker/attempt_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        return store

    listed = tuple(job_hosts(environ)) if dist_env.rank == 0 else ()
    return handshake(connect, Rendezvous(dist_env, job_identity(dist_env, environ), seconds, listed))


@contextmanager
def process_group(options: DistributedOptions | None = None,
                  environ: Mapping[str, str] | None = None, *,
                  start: GroupStarter | None = None) -> Iterator[DistContext]:
    """Resolve, select, init; the group is destroyed on the way out, error or not.
    ``start``: starts the group in place of the rendezvous (see ``GroupStarter``); this
    rank's place is then the group's (a warm spare learns its rank only there)."""
    options = options or DistributedOptions()
    environ = os.environ if environ is None else environ
    too_old = unsupported(installed())
    if too_old:
        raise UserError(too_old)
    dist_env = resolve_env(environ, host_suffix=options.host_suffix, port_range=options.port_range)
    choice = select_device(
        requested(options.device, environ, DEVICE_VAR, options.config_device),
        requested(options.backend, environ, BACKEND_VAR, options.config_backend),
        local_rank=dist_env.local_rank,
        local_world_size=dist_env.local_world_size,
        env=environ,
    )
    if RECOVERY_SPARE_VAR not in environ:  # a warm spare has no device of its own until it takes a place
        choice.activate()
    # Checked on every rank, even alone, so a bad value shows up before it matters.
    check_fabric(choice.backend, environ, this_host(environ),
                 where=where_label(dist_env.rank, dist_env.world_size))
    rendezvous_timeout_s = parse_timeout(environ.get(RENDEZVOUS_TIMEOUT_VAR), options.rendezvous_timeout_s)
    initialize = dist_env.world_size > 1 or options.init_single_process or start is not None
    # Before anything connects: a loopback name across nodes would only hang.
    network = (check_network(dist_env, choice.backend, host_suffix=options.host_suffix, environ=environ)
               if initialize else NetworkPlan())
    settings = GroupStart(choice.backend, timedelta(seconds=options.timeout_s), choice.init_device_id, network)
    if start is not None:
        keeper = start(settings)
        try:
            # A warm spare takes a lost rank's place (RANK, LOCAL_RANK) only once started, and
            # its device with it: the one chosen before was its node's first rank's (its group,
            # made on a device over nccl, was moved there by InJobRecovery the same way).
            started = replace(resolve_env(environ, host_suffix=options.host_suffix,
                                          port_range=options.port_range),
                              rank=dist.get_rank(), world_size=dist.get_world_size())
            if started.local_rank != dist_env.local_rank:
                choice = select_device(choice.device_type, choice.backend, local_rank=started.local_rank,
                                       local_world_size=started.local_world_size, env=environ)
            if started.local_rank != dist_env.local_rank or RECOVERY_SPARE_VAR in environ:
                choice.activate()
            yield DistContext(started, choice, True, keeper)
        finally:
            gc.collect()  # DDP wrappers before their group (see end_process_group)
            keeper.close()
        return
    if initialize:
        log.debug("init_process_group %s at %s:%d", choice.backend, dist_env.master_addr,
                  dist_env.master_port)
        start_through_rendezvous(settings, dist_env, environ, rendezvous_timeout_s)
    try:
        yield DistContext(dist_env, choice, initialize)
    finally:
        if initialize:
            end_process_group()


def start_through_rendezvous(settings: GroupStart, dist_env: DistEnv, environ: Mapping[str, str],
                             rendezvous_timeout_s: float) -> None:
    """The default group: the bounded rendezvous (``create_store``), then ``settings.init``."""
    store = create_store(dist_env, settings.timeout, environ, rendezvous_timeout_s)
    settings.init(store, dist_env.rank, dist_env.world_size)
    store.set_timeout(settings.timeout)  # later store users (new groups) get the collective timeout


def end_process_group() -> None:
    """Destroy the default process group, if there is one, in an order that lets the
    interpreter exit cleanly afterwards.

    A DistributedDataParallel still alive (often in a reference cycle) when the group goes
    away, or a group left to interpreter exit, aborts the process at exit ("terminate
    called without an active exception", ~1 run in 4 with gloo): ``gc.collect()`` first
    finalizes it while the group lives. After a failure a peer may still be inside a
    collective with this rank, and destroying can then wait for it: ``ddp-hpc run`` ends
    the group this way only after a script that finished (ddp_hpc/run/script_runner.py).
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()

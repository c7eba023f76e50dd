"""The rendezvous handshake: connect to rank 0's store, check it is this job's, wait for all.

torch's ``TCPStore`` client can block for ever in its constructor when something other
than a store listens on the port (it waits for a reply that never comes), and a missing
rank shows up only as an opaque key timeout inside the backend's set-up. So the
rendezvous runs under its own time limit (``distributed.rendezvous_timeout_s``):

1. rank 0 writes a marker key with the job's identity; every other rank reads it and
   compares, so a store of another job on the same port is named as such;
2. every rank registers (``joined/<rank>`` = its host) and counts itself in; the last one
   to arrive opens the gate, and all wait for it;
3. past the time limit, each rank says what it saw in one line: no store answering at the
   address, another job's store, or which ranks never joined: rank 0 lists them as runs
   ("ranks 3-7, 12 (6 of 4096)") with the hosts they were to run on, found in a few store
   round trips however large the job (``_missing_ranks``).
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from ddp_hpc.contract import RENDEZVOUS_TIMEOUT_VAR
from ddp_hpc.startup.batches import KEYS_PER_REQUEST, store_batches
from ddp_hpc.environment import DistEnv, detect_launcher
from ddp_hpc.errors import UserError

T = TypeVar("T")

MARKER_KEY = "ddp_hpc/job"
JOINED_KEY = "ddp_hpc/joined"
GATE_KEY = "ddp_hpc/all_joined"
#: Runs of ranks (and hosts) listed by name when some never joined (the rest are counted).
MAX_NAMED = 16


class RendezvousError(UserError):
    """The ranks could not meet: nothing answering, another job's store, or missing ranks."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this rank meets the others."""

    env: DistEnv
    #: The same string on every rank of one job, different for another job on the port.
    identity: str
    timeout_s: float
    #: The job's hosts in node order (SLURM node list, PBS node file), read on rank 0 only:
    #: names the hosts of nodes none of whose ranks joined.
    listed_hosts: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return f"{self.env.master_addr}:{self.env.master_port}"

    @property
    def whoami(self) -> str:
        return f"rank {self.env.rank} on host {socket.gethostname()}"


def parse_timeout(raw: str | None, default: float) -> float:
    """``DDP_HPC_RENDEZVOUS_TIMEOUT`` if set (seconds > 0), else ``default``."""
    if raw is None or not raw.strip():
        return default
    try:
        seconds = float(raw)
    except ValueError:
        raise UserError(f"{RENDEZVOUS_TIMEOUT_VAR}={raw!r} is not a number of seconds") from None
    if not seconds > 0:
        raise UserError(f"{RENDEZVOUS_TIMEOUT_VAR}={raw!r} must be > 0 seconds")
    return seconds


def job_identity(dist_env: DistEnv, environ: Mapping[str, str]) -> str:
    """What every rank of this job knows alike: world size, launcher, and the variables the
    launcher says name its job and launch."""
    identity = detect_launcher(environ).identity(environ)
    return " ".join([f"world_size={dist_env.world_size}", f"launcher={dist_env.source}",
                     *(f"{name}={value}" for name, value in identity.items())])


def bounded(work: Callable[[], T], seconds: float, on_timeout: Callable[[], str]) -> T:
    """``work()``, or a ``RendezvousError`` with ``on_timeout()``'s text after ``seconds``.

    The work runs in a daemon thread because a blocked store call cannot be interrupted;
    past the time limit it is left behind (the CLI ends the process after reporting).
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="ddp-hpc-rendezvous", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise RendezvousError(on_timeout())
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _accepts(addr: str, port: int) -> bool:
    """Whether something accepts connections at ``addr:port`` (a store or a foreign program)."""
    try:
        with socket.create_connection((addr, port), timeout=2):
            return True
    except OSError:
        return False


#: A range of ranks with a gap is halved until it is this small, then checked key by key.
SPLIT_DOWN_TO = 8


def _joined_keys(ranks: Iterable[int]) -> list[str]:
    return [f"{JOINED_KEY}/{rank}" for rank in ranks]


def _missing_ranks(store: dist.Store, world_size: int) -> list[int]:
    """The ranks without a joined key, in a few store round trips when few are missing.

    One ``check`` answers for a range of up to ``KEYS_PER_REQUEST`` keys (true when all
    exist), so ranges are halved only where a gap is. When so many are missing that halving
    would cost more round trips than one ``check`` a rank, it checks each rank: never more.
    """
    absent_count = world_size - int(store.add(JOINED_KEY, 0))
    if absent_count <= 0:
        return []
    per_gap = 2 * math.ceil(math.log2(KEYS_PER_REQUEST / SPLIT_DOWN_TO)) + SPLIT_DOWN_TO
    if world_size // KEYS_PER_REQUEST + absent_count * per_gap >= world_size:
        return [rank for rank in range(world_size) if not store.check(_joined_keys([rank]))]
    missing: list[int] = []
    pending = [(first, min(first + KEYS_PER_REQUEST, world_size))
               for first in reversed(range(0, world_size, KEYS_PER_REQUEST))]
    while pending:
        first, end = pending.pop()
        if store.check(_joined_keys(range(first, end))):
            continue
        if end - first <= SPLIT_DOWN_TO:
            missing.extend(rank for rank in range(first, end) if not store.check(_joined_keys([rank])))
            continue
        middle = (first + end) // 2
        pending += [(middle, end), (first, middle)]
    return missing


def rank_ranges(ranks: Sequence[int], limit: int = MAX_NAMED) -> str:
    """``[3, 4, 5, 6, 7, 12]`` -> ``"3-7, 12"``: the first ``limit`` runs, the rest counted."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    named = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    left = sum(b - a + 1 for a, b in runs[limit:])
    return named + (f" and {left} more" if left else "")


def _short(host: str) -> str:
    return host.split(".", 1)[0]


def _hosts_of(store: dist.Store, missing: Sequence[int], env: DistEnv, listed: Sequence[str]) -> str:
    """Where the missing ranks were to run, by node (ranks fill one node before the next): a
    node's host as a rank of it that joined wrote it, else the job's node list at that index,
    if the list agrees with every host known here (rank 0's own, the joined ranks'): it does
    not after a restart that left a node out, or with ranks spread round-robin."""
    per_node = max(env.local_world_size, 1)
    by_node: dict[int, list[int]] = {}
    for rank in missing:
        by_node.setdefault(rank // per_node, []).append(rank)
    absent = set(missing)
    witnesses = {node: next((r for r in range(node * per_node, min((node + 1) * per_node, env.world_size))
                             if r not in absent), None) for node in by_node}
    asked = {node: rank for node, rank in witnesses.items() if rank is not None}
    nodes, witness_ranks = list(asked), list(asked.values())
    values = [value for batch in store_batches(_joined_keys(witness_ranks)) for value in store.multi_get(batch)]
    found = {node: value.decode(errors="replace") for node, value in zip(nodes, values)}
    known = {0: socket.gethostname(), **found}
    if any(node < len(listed) and _short(listed[node]) != _short(host) for node, host in known.items()):
        listed = ()
    named: dict[tuple[str, str], list[int]] = {}
    unknown: list[int] = []
    for node, ranks in sorted(by_node.items()):
        if node in found:
            named.setdefault((found[node], ""), []).extend(ranks)
        elif node < len(listed):
            named.setdefault((listed[node], ", from the node list"), []).extend(ranks)
        else:
            unknown.append(node)
    if not named:
        return ""
    text = ", ".join(f"{host} (ranks {rank_ranges(ranks)}{source})"
                     for (host, source), ranks in list(named.items())[:MAX_NAMED])
    if len(named) > MAX_NAMED:
        text += f" and {len(named) - MAX_NAMED} more hosts"
    if unknown:
        text += f"; host unknown for node(s) {rank_ranges(unknown)}"
    return text


@dataclass(frozen=True)
class Absent:
    """The ranks that did not join, compact at any size."""

    #: ``"ranks 3-7, 12 (6 of 4096)"`` or ``"rank 5 of 8"``
    ranks: str
    #: ``"c1 (ranks 3-7), c2 (ranks 12, from the node list)"``; empty when no host is known
    hosts: str


def absent_ranks(store: dist.Store, env: DistEnv, listed_hosts: Sequence[str] = ()) -> Absent | None:
    """Which ranks have not joined and where they were to run (rank 0's view at the gate's
    time limit), or None if all did. ``listed_hosts``: the job's node list, in node order."""
    missing = _missing_ranks(store, env.world_size)
    if not missing:
        return None
    if len(missing) == 1:
        ranks = f"rank {missing[0]} of {env.world_size}"
    else:
        ranks = f"ranks {rank_ranges(missing)} ({len(missing)} of {env.world_size})"
    return Absent(ranks, _hosts_of(store, missing, env, listed_hosts))


class _Progress:
    """How far this rank got, for the message when the time limit passes."""

    def __init__(self) -> None:
        self.stage = "connect"


#: A blocked call (a listener that never answers) is abandoned this long after the
#: time limit; the store's own waits end at the time limit and say more.
ABANDON_AFTER_S = 5.0


def _wait(store: dist.Store, key: str, give_up_at: float) -> bool:
    """Wait for ``key`` until ``give_up_at`` (monotonic); False if it timed out."""
    remaining = give_up_at - time.monotonic()
    if remaining <= 0:
        return store.check([key])
    try:
        store.wait([key], timedelta(seconds=remaining))
    except dist.DistError:
        if give_up_at - time.monotonic() > 1.0:
            raise  # not a timeout: the connection failed (rank 0 ended?)
        return False
    return True


def handshake(store_factory: Callable[[], dist.Store], meeting: Rendezvous) -> dist.Store:
    """Connect (``store_factory``), check the marker, join; all within ``meeting.timeout_s``."""
    progress = _Progress()
    rank, world_size = meeting.env.rank, meeting.env.world_size
    give_up_at = time.monotonic() + meeting.timeout_s
    limit = f"within {meeting.timeout_s:g}s (distributed.rendezvous_timeout_s)"

    def not_this_jobs() -> RendezvousError:
        return RendezvousError(f"{meeting.whoami}: the listener at {meeting.address} is not this job's ddp_hpc "
                               f"rendezvous (no job marker {limit}): another program holds the port; set "
                               "MASTER_PORT to a free port")

    def work() -> dist.Store:
        store = store_factory()
        if rank == 0:
            store.set(MARKER_KEY, meeting.identity)
        else:
            progress.stage = "marker"
            if not _wait(store, MARKER_KEY, give_up_at):
                raise not_this_jobs()
            found = store.get(MARKER_KEY).decode(errors="replace")
            if found != meeting.identity:
                raise RendezvousError(
                    f"{meeting.whoami}: the rendezvous store at {meeting.address} belongs to another job "
                    f"({found}), not this one ({meeting.identity}): set MASTER_PORT to a free port")
        progress.stage = "join"
        store.set(f"{JOINED_KEY}/{rank}", socket.gethostname())
        if store.add(JOINED_KEY, 1) == world_size:
            store.set(GATE_KEY, "open")
        if not _wait(store, GATE_KEY, give_up_at):
            absent = absent_ranks(store, meeting.env, meeting.listed_hosts) if rank == 0 else None
            if absent:
                where = f"; they were to run on {absent.hosts}" if absent.hosts else ""
                raise RendezvousError(f"{meeting.whoami}: {absent.ranks} did not join the rendezvous at "
                                      f"{meeting.address} {limit}{where}: see their logs for why")
            raise RendezvousError(f"{meeting.whoami}: not every one of the {world_size} ranks joined the rendezvous "
                                  f"at {meeting.address} {limit}: see rank 0's line for the missing ones")
        return store

    def on_timeout() -> str:
        if progress.stage == "connect":
            if rank == 0:
                return f"{meeting.whoami}: could not start the rendezvous store at {meeting.address} {limit}"
            if _accepts(meeting.env.master_addr, meeting.env.master_port):
                return (f"{meeting.whoami}: the listener at {meeting.address} did not answer as a rendezvous store "
                        f"{limit}: another program holds the port; set MASTER_PORT to a free port")
            return (f"{meeting.whoami}: no rendezvous store answered at {meeting.address} {limit}: rank 0 did "
                    f"not start or failed, or the address or port is wrong (check MASTER_ADDR/MASTER_PORT), or a "
                    f"firewall blocks the port; the ranks also need TCP to each other on any port for gloo")
        if progress.stage == "marker":
            return str(not_this_jobs())
        return (f"{meeting.whoami}: the rendezvous store at {meeting.address} stopped answering during the join "
                f"{limit}")

    try:
        return bounded(work, meeting.timeout_s + ABANDON_AFTER_S, on_timeout)
    except RendezvousError:
        raise
    except (dist.DistError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(f"{meeting.whoami}: rendezvous at {meeting.address} failed during "
                              f"{progress.stage}: {first[:200]}") from None

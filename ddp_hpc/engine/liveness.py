"""Which ranks went silent: the one heartbeat every rank keeps in a store.

When the watchdog fires, a rank only knows that its own collective does not finish. A
host that dropped off the network sends nothing, not even a reset, so no error says who
is gone. Each rank's heartbeat thread therefore bumps a counter in the rendezvous store
every ``interval_s``. The rank whose watchdog fires reads every counter twice,
``settle_s`` apart: ranks whose counter did not move are silent (their host lost the
network, or the process is frozen); ranks whose counter moved are alive and waiting too.
A rank that cannot reach the store itself is on the side that was cut off.

There is one heartbeat per rank, whoever reads it. Without in-job recovery it lives in the
rendezvous store (``RENDEZVOUS_KEYS``, by rank) and the watchdog starts it. Under ``ddp-hpc
launch --recover`` ``InJobRecovery`` starts it in the launch's store (engine/recovery/store.py
``BEAT_KEYS``, by slot), where the launch's hang detector reads the same counters, and hands
it out (``InJobRecovery.heartbeat``): a watchdog given it reports through it (``reporting``)
instead of starting a second thread. ``on_beat`` lets its owner act on each beat (the
recovery notices a newer group there).

With each beat a rank also publishes its status (``RankStatus``): the collective it is at
(engine/collectives.py) and the median time of its own work per step. The firing rank
names the ranks out of step in the collective sequence; rank 0's heartbeat compares the
step times on every beat and names a straggler (a rank at least ``STRAGGLER_FACTOR``
times the median of the others).
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ddp_hpc.engine.collectives import CollectivePosition, out_of_step
from ddp_hpc.startup.batches import store_batches

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BeatKeys:
    """Where heartbeats live in a store: each member's counter, host and status under ``prefix``."""

    prefix: str

    def beat(self, member: int | str) -> str:
        return f"{self.prefix}heartbeat/{member}"

    def host(self, member: int | str) -> str:
        return f"{self.prefix}host/{member}"

    def status(self, member: int | str) -> str:
        return f"{self.prefix}status/{member}"


#: The rendezvous store's heartbeats, one per rank.
RENDEZVOUS_KEYS = BeatKeys("ddp_hpc/")
#: A rank whose step time is at least this many times the median of the others' is named.
STRAGGLER_FACTOR = 2.0


@dataclass(frozen=True)
class RankStatus:
    """What a rank's heartbeat publishes besides the beat itself."""

    collective: CollectivePosition | None
    #: The median seconds of the rank's own work per step (watchdog.Watchdog.compute_s).
    step_s: float | None
    step: int

    def to_text(self) -> str:
        return json.dumps({"c": self.collective.to_text() if self.collective else None,
                           "s": self.step_s, "n": self.step})

    @classmethod
    def from_text(cls, text: str) -> RankStatus | None:
        try:
            data = json.loads(text)
            collective = CollectivePosition.from_text(data["c"]) if data.get("c") else None
            return cls(collective, float(data["s"]) if data.get("s") is not None else None, int(data["n"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    #: Its step time over the median of the other ranks'.
    ratio: float
    step_s: float
    others_s: float
    #: Its step when rank 0 named it.
    step: int

    def describe(self) -> str:
        return (f"straggler: rank {self.rank} (host {self.host}) takes {self.ratio:.1f}x the median step time of the "
                f"other ranks ({self.step_s:.3g}s vs {self.others_s:.3g}s of its own work a step, at step {self.step})")


def find_stragglers(step_s: dict[int, float], factor: float = STRAGGLER_FACTOR) -> list[tuple[int, float, float]]:
    """``(rank, ratio, median of the others)`` for each rank at least ``factor`` times the
    median of the others' step times. The others, not all: of two ranks, the median of
    both would hide a rank 3x slower (3 / 2 = 1.5)."""
    found = []
    for rank, seconds in sorted(step_s.items()):
        others = [value for other, value in step_s.items() if other != rank]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and seconds / median >= factor:
            found.append((rank, seconds / median, median))
    return found


def read_texts(store: dist.Store, keys: Sequence[str]) -> list[str | None]:
    """Each key's value, None for one not set (yet)."""
    values: list[str | None] = []
    for batch in store_batches(keys):
        if store.check(batch):
            values += [value.decode() for value in store.multi_get(batch)]
        else:
            values += [store.get(key).decode() if store.check([key]) else None for key in batch]
    return values


def describe_ranks(ranks: Sequence[int], hosts: dict[int, str]) -> str:
    """``"ranks 2, 3 on host h2"``; grouped by host, in rank order."""
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(hosts.get(rank, "?"), []).append(rank)
    parts = [f"rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))} on host {host}"
             for host, members in by_host.items()]
    return "; ".join(parts)


def read_counters(store: dist.Store, keys: Sequence[str]) -> list[int]:
    """Every counter's value: batched reads where all exist (the usual case), else one
    ``add(key, 0)`` a key (which also creates a missing one at 0, for the second read)."""
    values: list[int] = []
    for batch in store_batches(keys):
        if store.check(batch):
            values += [int(value) for value in store.multi_get(batch)]
        else:
            values += [store.add(key, 0) for key in batch]
    return values


def read_beats(store: dist.Store, keys: BeatKeys, members: Sequence[int]) -> dict[int, int]:
    """Each member's heartbeat counter: what the watchdog's ``explain`` and the launch's hang
    detector (``LaunchStore.beats_of``) read, in requests of ``KEYS_PER_REQUEST`` keys."""
    return dict(zip(members, read_counters(store, [keys.beat(member) for member in members])))


class Heartbeat:
    """A daemon thread that bumps this rank's counter; ``explain()`` names the silent ranks.

    ``rank``: this member's number under ``keys`` (a rank, or under in-job recovery a slot);
    ``members``: the members to read, in rank order (default: ``range(world_size)``; the
    first, rank 0, checks for stragglers). ``on_beat(store)`` runs after each beat, on the
    heartbeat's thread and connection. A watchdog given it reports through it (``reporting``).
    """

    def __init__(self, rank: int, world_size: int, host: str, store_addr: str, store_port: int, *,
                 interval_s: float = 2.0, store_timeout_s: float = 5.0,
                 status: Callable[[], RankStatus] | None = None,
                 on_straggler: Callable[[Straggler], None] | None = None,
                 keys: BeatKeys = RENDEZVOUS_KEYS, members: Callable[[], Sequence[int]] | None = None,
                 on_beat: Callable[[dist.Store], None] | None = None, settle_s: float | None = None,
                 store_name: str = "rendezvous store") -> None:
        self.rank, self.world_size, self.host = rank, world_size, host
        self.keys, self.on_beat, self.store_name = keys, on_beat, store_name
        self.members: Callable[[], Sequence[int]] = members or (lambda: range(self.world_size))
        #: This rank's status, published with a beat at most every ``status_every_s``; the
        #: first member (rank 0) checks for stragglers then.
        self.status, self.on_straggler = status, on_straggler
        self.status_every_s = interval_s
        self._next_status = 0.0
        #: The first member: the stragglers named so far (each once, with its largest ratio).
        self.stragglers: dict[int, Straggler] = {}
        self.store_addr, self.store_port = store_addr, store_port
        self.where = f"{store_addr}:{store_port}"
        self.interval_s, self.store_timeout_s = interval_s, store_timeout_s
        self.settle_s = 2.5 * interval_s if settle_s is None else settle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ddp-hpc-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(timeout_s=1)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """The thread ends; waits up to ``timeout_s`` for a beat under way (one blocked on a
        dead network ends with ``store_timeout_s``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    @contextmanager
    def reporting(self, status: Callable[[], RankStatus], on_straggler: Callable[[Straggler], None] | None = None,
                  every_s: float | None = None) -> Iterator[Heartbeat]:
        """Publish ``status`` (every ``every_s``, default each beat) with the running beats
        while inside: a watchdog joining a heartbeat that another part of the process started."""
        previous = self.status, self.on_straggler, self.status_every_s
        self.status_every_s = self.interval_s if every_s is None else every_s
        self.status, self.on_straggler = status, on_straggler
        try:
            yield self
        finally:
            self.status, self.on_straggler, self.status_every_s = previous

    def _unreachable(self) -> str | None:
        """Why a TCP connection to the store fails, or None when it opens.

        Tried before every new store client: torch logs each failed client connection
        with a C++ stack trace, which would otherwise fill the job log every beat.
        """
        try:
            socket.create_connection((self.store_addr, self.store_port), timeout=self.store_timeout_s).close()
        except OSError as exc:
            return exc.strerror or str(exc) or type(exc).__name__
        return None

    def _connect(self) -> dist.Store:
        # A client of its own: a heartbeat blocked on a dead network holds no lock of the
        # store client the job uses.
        import torch.distributed as dist

        return dist.TCPStore(self.store_addr, self.store_port, is_master=False,
                             timeout=timedelta(seconds=self.store_timeout_s), wait_for_workers=False)

    def _beat(self) -> None:
        store: dist.Store | None = None
        while True:
            try:
                if store is None and self._unreachable() is None:
                    store = self._connect()
                    store.set(self.keys.host(self.rank), self.host)
                if store is not None:
                    self.beat_once(store)
            except Exception as exc:  # unreachable store: keep trying; explain() tells the story
                log.debug("heartbeat to %s failed: %s", self.where, exc)
                store = None
            if self._stop.wait(self.interval_s):
                return

    def beat_once(self, store: dist.Store) -> None:
        """One beat: the counter, the owner's ``on_beat``, the status when it is due."""
        store.add(self.keys.beat(self.rank), 1)
        if self.on_beat is not None:
            self.on_beat(store)
        status = self.status  # one read: a watchdog may stop reporting meanwhile
        if status is not None and time.monotonic() >= self._next_status:
            self._next_status = time.monotonic() + self.status_every_s
            store.set(self.keys.status(self.rank), status().to_text())
            members = self.members()
            if members and self.rank == members[0]:
                self._check_stragglers(store, members)

    def _check_stragglers(self, store: dist.Store, members: Sequence[int]) -> None:
        texts = read_texts(store, [self.keys.status(member) for member in members])
        statuses = {member: RankStatus.from_text(text) if text else None for member, text in zip(members, texts)}
        step_s = {rank: status.step_s for rank, status in statuses.items()
                  if status is not None and status.step_s is not None}
        log.debug("median step times of the ranks' own work: %s", step_s)
        for rank, ratio, others in find_stragglers(step_s):
            known = self.stragglers.get(rank)
            if known is not None and known.ratio >= ratio:
                continue
            host_key = self.keys.host(rank)
            host = store.get(host_key).decode() if store.check([host_key]) else "?"
            status = statuses[rank]
            found = Straggler(rank, host, round(ratio, 2), step_s[rank], others, status.step if status else 0)
            self.stragglers[rank] = found
            if known is None:
                log.warning("%s", found.describe())
            on_straggler = self.on_straggler
            if on_straggler is not None:
                on_straggler(found)

    def collectives(self, store: dist.Store) -> str:
        """Which rank is out of step in the collective sequence (engine/collectives.py)."""
        ranks = list(self.members())
        statuses = read_texts(store, [self.keys.status(r) for r in ranks])
        hosts = read_texts(store, [self.keys.host(r) for r in ranks])
        positions = {}
        for rank, text in zip(ranks, statuses):
            status = RankStatus.from_text(text) if text else None
            positions[rank] = status.collective if status else None
        return out_of_step(positions, {rank: host for rank, host in zip(ranks, hosts) if host})

    def explain_collectives(self) -> str:
        """The collectives line alone, for a collective that timed out (nothing to settle)."""
        try:
            return self.collectives(self._connect())
        except Exception as exc:
            return f"cannot read the ranks' collectives from the {self.store_name} at {self.where} ({exc})"

    def explain(self) -> str:
        """One sentence: who went silent, or that nobody did, or that this rank is cut off."""
        members = list(self.members())
        cut_off = (f"this rank cannot reach the {self.store_name} at {self.where} either ({{}}): host "
                   f"{self.host} has likely lost the job's network")
        reason = self._unreachable()
        if reason is not None:
            return cut_off.format(reason)
        try:
            store = self._connect()
            before = read_beats(store, self.keys, members)
            time.sleep(self.settle_s)
            after = read_beats(store, self.keys, members)
            silent = [rank for rank in members if before[rank] == after[rank]]
            hosts = {rank: store.get(self.keys.host(rank)).decode()
                     for rank in silent if store.check([self.keys.host(rank)])}
            collectives = self.collectives(store) if self.status is not None else None
        except Exception as exc:
            text = str(exc).strip()
            return cut_off.format(text.splitlines()[0][:160] if text else type(exc).__name__)
        if not silent:
            liveness = ("every rank's heartbeat still moves, so no rank is gone: one is stuck in its own code "
                        "or out of step (see the stacks below)")
        else:
            liveness = (f"silent: {describe_ranks(silent, hosts)} (no heartbeat for {self.settle_s:.0f}s, while the "
                        f"{self.store_name} at {self.where} still answers this rank): that host has likely lost "
                        f"the network, or those processes are frozen")
        return liveness if collectives is None else f"{liveness}\ncollectives: {collectives}"

"""Which ranks went silent: a heartbeat every rank keeps in the rendezvous store.

When the watchdog fires, a rank only knows that its own collective does not finish. A
host that dropped off the network sends nothing, not even a reset, so no error says who
is gone. Each rank's heartbeat thread therefore bumps a counter in the rendezvous store
every ``interval_s``. The rank whose watchdog fires reads every counter twice,
``settle_s`` apart: ranks whose counter did not move are silent (their host lost the
network, or the process is frozen); ranks whose counter moved are alive and waiting too.
A rank that cannot reach the store itself is on the side that was cut off.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch.distributed as dist

from ddp_hpc.engine.watchdog import Watchdog

log = logging.getLogger(__name__)

BEAT_KEY = "ddp_hpc/heartbeat/{rank}"
HOST_KEY = "ddp_hpc/host/{rank}"


def describe_ranks(ranks: Sequence[int], hosts: dict[int, str]) -> str:
    """``"ranks 2, 3 on host h2"``; grouped by host, in rank order."""
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(hosts.get(rank, "?"), []).append(rank)
    parts = [f"rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))} on host {host}"
             for host, members in by_host.items()]
    return "; ".join(parts)


def read_counters(store: dist.Store, keys: Sequence[str]) -> list[int]:
    """Every counter's value: one batched read when all exist (the usual case), else one
    ``add(key, 0)`` a key (which also creates a missing one at 0, for the second read)."""
    if store.check(list(keys)):
        return [int(value) for value in store.multi_get(list(keys))]
    return [store.add(key, 0) for key in keys]


class Heartbeat:
    """A daemon thread that bumps this rank's counter; ``explain()`` names the silent ranks."""

    def __init__(self, rank: int, world_size: int, host: str, store_addr: str, store_port: int, *,
                 interval_s: float = 2.0, store_timeout_s: float = 5.0) -> None:
        self.rank, self.world_size, self.host = rank, world_size, host
        self.store_addr, self.store_port = store_addr, store_port
        self.where = f"{store_addr}:{store_port}"
        self.interval_s, self.store_timeout_s = interval_s, store_timeout_s
        self.settle_s = 2.5 * interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ddp-hpc-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1)  # a beat blocked on a dead network ends with its timeout

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
        return dist.TCPStore(self.store_addr, self.store_port, is_master=False,
                             timeout=timedelta(seconds=self.store_timeout_s), wait_for_workers=False)

    def _beat(self) -> None:
        store: dist.Store | None = None
        while True:
            try:
                if store is None and self._unreachable() is None:
                    store = self._connect()
                    store.set(HOST_KEY.format(rank=self.rank), self.host)
                if store is not None:
                    store.add(BEAT_KEY.format(rank=self.rank), 1)
            except Exception as exc:  # unreachable store: keep trying; explain() tells the story
                log.debug("heartbeat to %s failed: %s", self.where, exc)
                store = None
            if self._stop.wait(self.interval_s):
                return

    def explain(self) -> str:
        """One sentence: who went silent, or that nobody did, or that this rank is cut off."""
        keys = [BEAT_KEY.format(rank=r) for r in range(self.world_size)]
        cut_off = (f"this rank cannot reach the rendezvous store at {self.where} either ({{}}): host "
                   f"{self.host} has likely lost the job's network")
        reason = self._unreachable()
        if reason is not None:
            return cut_off.format(reason)
        try:
            store = self._connect()
            before = read_counters(store, keys)
            time.sleep(self.settle_s)
            after = read_counters(store, keys)
            silent = [rank for rank in range(self.world_size) if before[rank] == after[rank]]
            hosts = {rank: store.get(HOST_KEY.format(rank=rank)).decode()
                     for rank in silent if store.check([HOST_KEY.format(rank=rank)])}
        except Exception as exc:
            text = str(exc).strip()
            return cut_off.format(text.splitlines()[0][:160] if text else type(exc).__name__)
        if not silent:
            return ("every rank's heartbeat still moves, so no rank is gone: one is stuck in its own code "
                    "(see the stacks below)")
        return (f"silent: {describe_ranks(silent, hosts)} (no heartbeat for {self.settle_s:.0f}s, while the "
                f"rendezvous store at {self.where} still answers this rank): that host has likely lost "
                f"the network, or those processes are frozen")


@contextmanager
def watchdog(limit_s: float, *, heartbeat_store: tuple[str, int] | None = None,
             limit_name: str = "watchdog limit_s") -> Iterator[Watchdog]:
    """A watchdog for a loop of one's own: call ``.beat()`` at every step; a rank that
    makes no progress for ``limit_s`` seconds logs where it was stuck, which ranks went
    silent, every thread's stack, and exits (status 3) so the launcher ends the job.

    The heartbeat uses the rendezvous store at ``heartbeat_store`` (host, port), by
    default ``$MASTER_ADDR:$MASTER_PORT`` of the running process group. ``limit_name``
    is how the message names the limit (the Trainer's: ``distributed.watchdog_s``).
    """
    if limit_s <= 0:
        raise ValueError(f"watchdog: limit_s={limit_s} must be > 0")
    rank, world_size, store = 0, 1, heartbeat_store
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if store is None and world_size > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    with _watching(limit_s, rank, world_size, store if world_size > 1 else None, limit_name) as dog:
        yield dog


@contextmanager
def _watching(limit_s: float, rank: int, world_size: int, store: tuple[str, int] | None,
              limit_name: str = "distributed.watchdog_s") -> Iterator[Watchdog]:
    heartbeat = None
    if store is not None:
        heartbeat = Heartbeat(rank, world_size, socket.gethostname(), store[0], store[1],
                              interval_s=min(max(limit_s / 10, 1.0), 10.0))
    with heartbeat or nullcontext(), \
            Watchdog(limit_s, rank, diagnose=heartbeat.explain if heartbeat else None,
                     limit_name=limit_name) as dog:
        yield dog

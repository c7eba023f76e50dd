"""The watchdog: a rank that makes no progress for too long ends the job loudly.

A collective that never completes (a peer stuck in user code, a lost node the backend
does not notice) would otherwise hold the job until its walltime. A loop (a user's own, or
the Trainer's) runs inside ``watchdog(limit_s)`` and calls ``beat(phase)`` at every step;
a daemon thread checks the time since the last beat and, past the limit, logs which rank on
which host was stuck in which phase, which ranks went silent and which are out of step in
the collectives (the heartbeat: ``engine/liveness.py``), dumps every thread's stack
(showing the blocked collective) and exits the process, so the launcher ends the job.
This is the one watchdog: the Trainer's ``distributed.watchdog_s`` is this context manager
around its training.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch.distributed as dist

from ddp_hpc.contract import ExitStatus
from ddp_hpc.engine.collectives import position
from ddp_hpc.engine.liveness import Heartbeat, RankStatus, Straggler

log = logging.getLogger(__name__)

#: How many recent steps a rank's step time is the median of (what the straggler check compares).
STEP_WINDOW = 20
#: Fewer steps than this give no step time yet (the first steps include warm-up).
MIN_STEPS = 5


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, poll_s: float = 1.0,
                 diagnose: Callable[[], str] | None = None, limit_name: str = "distributed.watchdog_s") -> None:
        self.timeout_s, self.rank, self.poll_s = timeout_s, rank, min(poll_s, timeout_s / 4)
        #: Says who is to blame when the watchdog fires (liveness.Heartbeat.explain).
        self.diagnose = diagnose
        #: What the user set the limit with, named in the message.
        self.limit_name = limit_name
        self._last = time.monotonic()
        self._phase = "start-up"
        self._step = 0
        self._compute: deque[float] = deque(maxlen=STEP_WINDOW)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddp-hpc-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def beat(self, phase: str = "training", step: int | None = None, compute_s: float | None = None) -> None:
        """Progress: cheap enough to call every step (a few attribute stores).

        ``compute_s``: the seconds of this step's own work, outside any collective (the
        forward pass): what the straggler check compares between ranks. Wall time per step
        would not do: every rank waits in the collectives for the slowest one.
        """
        self._phase, self._step = phase, self._step + 1 if step is None else step
        if compute_s is not None:
            self._compute.append(compute_s)
        self._last = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self._last

    @property
    def step(self) -> int:
        return self._step

    def compute_s(self) -> float | None:
        """The median of the last ``STEP_WINDOW`` steps' ``compute_s``; None before ``MIN_STEPS``."""
        recent = list(self._compute)  # one C-level copy: safe against the loop's appends
        return statistics.median(recent) if len(recent) >= MIN_STEPS else None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        if self.diagnose is not None:
            try:
                cause = self.diagnose()
            except Exception as exc:  # the diagnosis must never keep the process alive
                cause = f"cannot tell which rank is to blame ({exc})"
            for part in cause.splitlines():
                _say(f"[rank {self.rank}] watchdog: {part}")
        message = (f"[rank {self.rank}] watchdog: no progress for {idle:.0f}s on host {socket.gethostname()} "
                   f"during {self._phase} after step {self._step} (limit {self.limit_name}="
                   f"{self.timeout_s:g}); a collective is likely waiting for a rank that is stuck or gone. "
                   f"Stacks of every thread follow; exiting with status {ExitStatus.WATCHDOG:d}.")
        _say(message)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(ExitStatus.WATCHDOG)


def _say(line: str) -> None:
    """The line to the process's logging where it is set up (a rank's log file keeps it), and
    on stderr, which the launcher keeps, unless a handler already wrote it there: once each."""
    if log.hasHandlers():
        log.error(line)
    if not _logs_to_stderr(log):
        print(line, file=sys.stderr, flush=True)


def _logs_to_stderr(logger: logging.Logger) -> bool:
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                return True
        current = current.parent if current.propagate else None
    return False


@contextmanager
def watchdog(limit_s: float, *, heartbeat_store: tuple[str, int] | None = None,
             on_straggler: Callable[[Straggler], None] | None = None,
             limit_name: str = "watchdog limit_s", heartbeat: Heartbeat | None = None) -> Iterator[Watchdog]:
    """A watchdog for a loop of one's own: call ``.beat()`` at every step; a rank that
    makes no progress for ``limit_s`` seconds logs where it was stuck, which ranks went
    silent, which ranks are out of step in the collectives (with ``TORCH_FR_BUFFER_SIZE``
    set, as ``ddp-hpc run`` does), every thread's stack, and exits (status 3) so the
    launcher ends the job. ``.beat(compute_s=...)`` with the seconds of the step's own
    work lets rank 0 log stragglers (and call ``on_straggler``).

    The rank's one heartbeat: ``heartbeat`` when given (``InJobRecovery.heartbeat``, in the
    launch's store: no second thread), else one of the watchdog's own in the rendezvous
    store at ``heartbeat_store`` (host, port), by default
    ``$MASTER_ADDR:$MASTER_PORT`` of the running process group. ``limit_name`` is how the
    message names the limit (the Trainer's: ``distributed.watchdog_s``).
    """
    if limit_s <= 0:
        raise ValueError(f"watchdog: limit_s={limit_s} must be > 0")
    rank, world_size, store = 0, 1, heartbeat_store
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if store is None and world_size > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    with _watching(limit_s, rank, world_size, store if world_size > 1 else None, limit_name,
                   on_straggler=on_straggler, heartbeat=heartbeat) as dog:
        yield dog


def rank_status(dog: Watchdog, interval_s: float) -> RankStatus:
    """What this rank's heartbeat publishes: its step time, and its collective once it has
    made no progress for a beat. Only then: a dump of the flight recorder costs ~40 us an
    entry (80 ms with the 2,000 entries torch suggests for NCCL), and a rank that beats has
    nothing to explain."""
    collective = None
    if dog.idle_s() >= interval_s:
        try:
            collective = position()
        except Exception as exc:  # an unexpected flight-record layout must not stop the heartbeat
            log.debug("no flight record: %s", exc)
    return RankStatus(collective, dog.compute_s(), dog.step)


@contextmanager
def _watching(limit_s: float, rank: int, world_size: int, store: tuple[str, int] | None,
              limit_name: str = "distributed.watchdog_s",
              on_straggler: Callable[[Straggler], None] | None = None,
              heartbeat: Heartbeat | None = None) -> Iterator[Watchdog]:
    """``heartbeat``: a running one to report through; else, with ``store``, one of its own."""
    dog = Watchdog(limit_s, rank, limit_name=limit_name)
    interval_s = min(max(limit_s / 10, 1.0), 10.0)
    beating: AbstractContextManager[object] = nullcontext()
    if heartbeat is not None:
        beating = heartbeat.reporting(lambda: rank_status(dog, interval_s), on_straggler, every_s=interval_s)
    elif store is not None:
        heartbeat = beating = Heartbeat(rank, world_size, socket.gethostname(), store[0], store[1],
                                        interval_s=interval_s, status=lambda: rank_status(dog, interval_s),
                                        on_straggler=on_straggler)
    if heartbeat is not None:
        dog.diagnose = heartbeat.explain
    with beating, dog:
        try:
            yield dog
        except Exception as exc:
            if heartbeat is not None and is_collective_timeout(exc):
                log.error("a collective timed out; collectives: %s", heartbeat.explain_collectives())
            raise


def is_collective_timeout(exc: BaseException) -> bool:
    """gloo's ``Timed out waiting 600000ms for recv operation``, NCCL's ``Watchdog caught
    collective operation timeout``: the process group's own timeout (distributed.timeout_s)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)

"""A progress watchdog: a rank that makes no progress for too long ends the job loudly.

A collective that never completes (a peer stuck in user code, a lost node the backend
does not notice) would otherwise hold the job until its walltime. The training loop
calls ``beat(phase)`` at every step; a daemon thread checks the time since the last beat
and, past the limit, logs which rank on which host was stuck in which phase, dumps every
thread's stack (showing the blocked collective) and exits the process, so the launcher
ends the job.
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
from collections.abc import Callable

log = logging.getLogger(__name__)

EXIT_CODE = 3
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
                line = f"[rank {self.rank}] watchdog: {part}"
                log.error(line)
                print(line, file=sys.stderr, flush=True)
        message = (f"[rank {self.rank}] watchdog: no progress for {idle:.0f}s on host {socket.gethostname()} "
                   f"during {self._phase} after step {self._step} (limit {self.limit_name}="
                   f"{self.timeout_s:g}); a collective is likely waiting for a rank that is stuck or gone. "
                   f"Stacks of every thread follow; exiting with status {EXIT_CODE}.")
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_CODE)

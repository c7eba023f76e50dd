"""``ddp-hpc launch`` on this machine: the process that owns the ranks' processes.

Each attempt starts the ranks (the ``start`` of one of ``launch/attempts.py``'s ``Attempts``:
each rank as a child with torchrun's worker variables, one ``mpiexec``, one srun step), passes
a stop signal on, sees every
child's real exit status, ends the others when one fails, and asks the one restart policy
(``launch/restart.py``) what follows. torchrun is not used underneath: its agent turns any
non-zero status into 1 and restarts a stop (75) as a failure, so neither a requeue nor a
restart could keep the contract through it.

In-job recovery (issue 31) sits here: the supervisor knows which rank ended and keeps the
others' ``Popen``; given an ``InJob`` (``launch/recovering.py``'s ``Recoverer``) it asks it on
each failure, and where it starts that rank again (or lets the others go on without it),
the attempt goes on instead of ending (see docs/architecture.md).

Library code: ``entry.launch`` builds the one ``Supervisor`` of a launch; the signal handlers
it names are installed by the CLI's function, and call ``Supervisor.request_stop``.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ddp_hpc.contract import AGREED_EXIT_STATUSES, ExitStatus
from ddp_hpc.launch.attempts import signal_running
from ddp_hpc.launch.restart import Decision, RestartPolicy

log = logging.getLogger(__name__)

#: How long the other ranks have to end after SIGTERM once one failed (torchrun's agent
#: also waits 30 s before SIGKILL).
END_GRACE_S = 30.0
#: How often the supervisor looks at its children.
POLL_S = 0.05

#: Starts one attempt's processes: ``attempt`` (0 first) -> the children.
StartAttempt = Callable[[int], Sequence[subprocess.Popen]]
#: Passes a stop on to an attempt's processes, where signalling them is not the way: ``(signum, children)``.
ForwardStop = Callable[[int, Sequence[subprocess.Popen]], None]
#: What an attempt's status means, where the launcher hides it: ``(attempt, status)`` -> the
#: status the policy sees (srun's ``--kill-on-bad-exit`` turns the ranks' 75 into a kill).
ReadStatus = Callable[[int, int], int]


class InJob(Protocol):
    """Recovery inside the attempt (``launch/recovering.py``'s ``Recoverer``)."""

    def on_failure(self, index: int, status: int, children: list[subprocess.Popen]) -> bool:
        """Process ``index`` failed: True when the attempt goes on (its replacement is in
        ``children[index]``, or the others go on without it)."""

    def watch(self, children: list[subprocess.Popen]) -> None:
        """Called on every look at the children: may kill a frozen one."""

    def close(self) -> None:
        """The attempt ended: end what it started beside the children (a warm spare)."""

    def forward(self, signum: int, children: list[subprocess.Popen]) -> None:
        """Pass a stop signal on to the running children; one for a replacement still
        starting is held until it can take it (``deliver``)."""

    def deliver(self, children: list[subprocess.Popen]) -> None:
        """Called on every look at the children, a stop included: passes held signals on."""


class Supervisor:
    """Attempts of a launch under one ``RestartPolicy``; ``run()`` returns the launch's status."""

    def __init__(self, start: StartAttempt, policy: RestartPolicy, end_grace_s: float = END_GRACE_S,
                 in_job: InJob | None = None, read_status: ReadStatus | None = None,
                 forward_stop: ForwardStop | None = None) -> None:
        self._start, self.policy, self.end_grace_s, self.in_job = start, policy, end_grace_s, in_job
        self._read_status, self._forward = read_status, forward_stop
        self._children: list[subprocess.Popen] = []
        self.stop_signal: int | None = None

    def request_stop(self, signum: int) -> None:
        """A stop signal reached the launch (the CLI's handler calls this): the ranks get it,
        checkpoint at an agreed step and exit 75; nothing is restarted after it."""
        if self.stop_signal is None:
            log.warning("stop signal (time limit or preemption): the ranks checkpoint and stop")
        self.stop_signal = signum
        self._forward_stop(signum)

    def run(self) -> int:
        """The launch's exit status."""
        return self.run_to_decision().status

    def run_to_decision(self) -> Decision:
        """The policy's last decision: the launch's status, and whether it asks for a requeue."""
        attempt = 0
        while True:
            if self.stop_signal is not None:  # asked to stop before the ranks started: nothing to save
                return Decision(restart=False, status=ExitStatus.REQUEUE, requeue=True)
            self._children = list(self._start(attempt))
            if self.stop_signal is not None:  # came while they were being started
                self._forward_stop(self.stop_signal)
            try:
                status = self._wait_for_attempt()
            except KeyboardInterrupt:
                self._end_running(signal.SIGINT)
                raise
            except BaseException:  # e.g. a replacement that could not start: no rank outlives its supervisor
                self._end_running(signal.SIGTERM)
                raise
            finally:
                if self.in_job is not None:
                    self.in_job.close()
            if self._read_status is not None:
                status = self._read_status(attempt, status)
            decision = self.policy.decide(status, attempt, stop_requested=self.stop_signal is not None)
            if not decision.restart:
                return decision
            attempt += 1
            log.warning("the ranks failed (exit %d): restart %d of %d, resuming from the newest checkpoint",
                        status, attempt, self.policy.max_restarts)

    def _wait_for_attempt(self) -> int:
        """The attempt's status: the first failure's (after which the others are ended),
        else 75 if any process stopped on request, else 0."""
        statuses: dict[int, int] = {}
        first_failure: int | None = None
        kill_at: float | None = None
        failed_at = 0.0
        while len(statuses) < len(self._children):
            if self.in_job is not None and first_failure is None:
                if self.stop_signal is None:
                    self.in_job.watch(self._children)
                self.in_job.deliver(self._children)
            for index, child in enumerate(self._children):
                if index in statuses or child.poll() is None:
                    continue
                statuses[index] = ExitStatus.of_returncode(child.returncode)
                if (first_failure is None and statuses[index] not in AGREED_EXIT_STATUSES
                        and self.in_job is not None and self.stop_signal is None
                        and self.in_job.on_failure(index, statuses[index], self._children)):
                    if self._children[index] is child:  # went on without it
                        statuses[index] = ExitStatus.OK
                    else:
                        del statuses[index]
                    continue
                if first_failure is None and statuses[index] not in AGREED_EXIT_STATUSES:
                    first_failure = statuses[index]
                    log.error("process %d of %d (pid %d) exited with status %d: ending the others",
                              index, len(self._children), child.pid, first_failure)
                    self._signal_running(signal.SIGTERM)
                    failed_at = time.monotonic()
                    kill_at = failed_at + self.end_grace_s
            if kill_at is not None and time.monotonic() >= kill_at:
                self._signal_running(signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_S)
        if first_failure is not None:
            log.warning("the attempt's other processes ended within %.1f s", time.monotonic() - failed_at)
            return first_failure
        return ExitStatus.REQUEUE if ExitStatus.REQUEUE in statuses.values() else ExitStatus.OK

    def _forward_stop(self, signum: int) -> None:
        if self.in_job is not None:
            self.in_job.forward(signum, self._children)
        elif self._forward is not None:
            self._forward(signum, self._children)
        else:
            self._signal_running(signum)

    def _signal_running(self, signum: int) -> None:
        signal_running(self._children, signum)

    def _end_running(self, signum: int) -> None:
        self._signal_running(signum)
        give_up_at = time.monotonic() + self.end_grace_s
        for child in self._children:
            try:
                child.wait(max(0.0, give_up_at - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

"""``ddp-hpc launch`` on this machine: the process that owns the ranks' processes.

Each attempt starts the ranks (``RankStarter``: each rank as a child with torchrun's worker
variables, or one ``mpiexec`` that starts them), passes a stop signal on, sees every
child's real exit status, ends the others when one fails, and asks the one restart policy
(``launch/restart.py``) what follows. torchrun is not used underneath: its agent turns any
non-zero status into 1 and restarts a stop (75) as a failure, so neither a requeue nor a
restart could keep the contract through it.

In-job recovery (issue 31) sits here: the supervisor knows which rank ended and keeps the
others' ``Popen``; given an ``InJob`` (``launch/recovering.py``'s ``Recoverer``) it asks it on
each failure, and where it starts that rank again (or lets the others go on without it),
the attempt goes on instead of ending (see docs/architecture.md).

Library code: signal handlers are the CLI's; it calls ``Supervisor.request_stop``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ddp_hpc.contract import AGREED_EXIT_STATUSES, PREEMPTED_MARKER, RESTART_COUNT_VAR, ExitStatus
from ddp_hpc.environment import DistEnv
from ddp_hpc.environment.ports import free_port
from ddp_hpc.errors import UserError
from ddp_hpc.launch.restart import Decision, RestartPolicy
from ddp_hpc.run.torchrun_env import torchrun_variables

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


@dataclass(frozen=True)
class LocalRanks:
    """``nproc`` ranks of ``command`` on this machine, each with torchrun's worker variables
    (``torch/distributed/elastic/agent/server/local_elastic_agent.py``, ``_start_workers``):
    scripts written for torchrun and ddp_hpc's own verbs (``TorchrunEnvironment``) read them."""

    nproc: int
    command: Sequence[str]
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    #: A node supervisor's (``launch/node.py``): this node's place among ``num_nodes``, each
    #: with ``nproc`` ranks, and where they meet.
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"

    @property
    def world_size(self) -> int:
        return self.nproc * self.num_nodes

    def environment(self, local_rank: int, attempt: int, port: int, run_id: str) -> dict[str, str]:
        rank = DistEnv(rank=self.node_rank * self.nproc + local_rank, world_size=self.world_size,
                       local_rank=local_rank, local_world_size=self.nproc, node_rank=self.node_rank,
                       num_nodes=self.num_nodes, master_addr=self.master_addr, master_port=port,
                       source="ddp-hpc launch")
        env = {**self.base_env, **torchrun_variables(rank, run_id, attempt), RESTART_COUNT_VAR: str(attempt)}
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if self.nproc > 1 and not env.get("OMP_NUM_THREADS", "").strip():
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: ranks sharing a node do not oversubscribe it
        return env

    def start(self, attempt: int) -> list[subprocess.Popen]:
        """Every rank of attempt ``attempt``; rank 0 serves a fresh store on a free port."""
        port, run_id = free_port(), uuid.uuid4().hex[:12]
        return start_all([(self.command, self.environment(local_rank, attempt, port, run_id))
                          for local_rank in range(self.nproc)])


@dataclass(frozen=True)
class OneLauncher:
    """One process per attempt that starts the ranks itself (``mpiexec`` on this machine).
    Each attempt's ranks meet on a free port (unless ``MASTER_PORT`` is set): a rank of
    one machine otherwise derives it from its parent, which the rank wrapper replaces."""

    argv: Sequence[str]
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def start(self, attempt: int) -> list[subprocess.Popen]:
        env = {**self.base_env, RESTART_COUNT_VAR: str(attempt)}
        if not env.get("MASTER_PORT", "").strip():
            env["MASTER_PORT"] = str(free_port())
        return start_all([(self.argv, env)])


def start_all(processes: Sequence[tuple[Sequence[str], Mapping[str, str]]]) -> list[subprocess.Popen]:
    """Start each ``(argv, env)``; a command that cannot start is the user's mistake (one line),
    and ends the ones already started."""
    started: list[subprocess.Popen] = []
    for argv, env in processes:
        try:
            started.append(subprocess.Popen(list(argv), env=dict(env)))
        except OSError as exc:
            for child in started:
                child.kill()
                child.wait()
            raise UserError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
    return started


@dataclass(frozen=True)
class MarkedAttempts:
    """Starts each attempt (``start_attempt``) and reads its status through the preempted
    marker rank 0 (or, under MPICH, its wrapper) writes in ``run_folder`` after a stop: the
    ranks stopped, whatever the launcher says. One that ends the other ranks once one exits
    (srun's ``--kill-on-bad-exit``) reports the stop as a kill; MPICH's Hydra, having passed a
    SIGTERM on, may report the ranks' 75 as 0. The one reader of the marker.

    The marker is removed before each attempt starts (the one before it has ended), so one
    found at its end was written during it: no clock is compared (a file system's clock may
    lag this machine's, or run ahead of it)."""

    start_attempt: StartAttempt
    run_folder: Path

    def start(self, attempt: int) -> Sequence[subprocess.Popen]:
        marker = self.run_folder / PREEMPTED_MARKER
        try:
            marker.unlink(missing_ok=True)
        except OSError as exc:  # left there, it would read every end of the attempt as a stop
            raise UserError(f"cannot remove the preempted marker {marker} before the ranks start: "
                            f"{exc.strerror or exc}") from None
        return self.start_attempt(attempt)

    def read_status(self, attempt: int, status: int) -> int:
        return ExitStatus.REQUEUE if (self.run_folder / PREEMPTED_MARKER).exists() else status


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
        for child in self._children:
            if child.returncode is None:
                try:
                    child.send_signal(signum)
                except ProcessLookupError:
                    pass

    def _end_running(self, signum: int) -> None:
        self._signal_running(signum)
        deadline = time.monotonic() + self.end_grace_s
        for child in self._children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

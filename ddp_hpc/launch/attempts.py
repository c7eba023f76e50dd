"""``Attempts``: one way of starting a launch's ranks, an attempt at a time.

One implementation per way (``ddp-hpc launch --launcher ...``): ``local.LocalRanks`` (each rank
a child of the launch, with torchrun's variables), ``local.MpiexecHere`` (one mpiexec on this
machine), ``hosts.HostfileAttempts`` (one mpiexec over the hosts of a file), ``srun.SrunSteps``
(one srun step in a SLURM allocation). Two wrappers take any of them: ``MarkedAttempts``
(the attempt's ``Outcome``: its status through the preempted marker, the failed host left
out of a restart) and ``node.NodeSupervisors`` (one node supervisor per node around the
recovery store). ``entry.launch`` runs them under the one ``Supervisor``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ddp_hpc.contract import PREEMPTED_MARKER
from ddp_hpc.errors import UserError
from ddp_hpc.launch.outcome import NamesFailedHost, Outcome, attempt_outcome


class Attempts(Protocol):
    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> Sequence[subprocess.Popen]:
        """Start attempt ``attempt`` (0 first), its processes seeing ``extra_env`` besides their own:
        the processes the supervisor waits for."""

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        """Pass a stop on to a running attempt's processes (``signum``: what the launch's signal table
        says the launcher passes on)."""

    def read_status(self, attempt: int, status: int) -> int:
        """What the attempt's ``status`` means, where the launcher hides it."""

    def describe(self) -> str:
        """``--dry-run``: what each attempt starts."""


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


def signal_running(children: Sequence[subprocess.Popen], signum: int) -> None:
    for child in children:
        if child.returncode is None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass


@dataclass
class MarkedAttempts:
    """``attempts`` whose end is read as an ``Outcome`` (launch/outcome.py): the launcher's
    status, the preempted marker rank 0 (or, under MPICH, its wrapper) writes in
    ``run_folder`` after a stop (the ranks stopped, whatever the launcher says: one that ends
    the other ranks once one exits, srun's ``--kill-on-bad-exit``, reports the stop as a kill;
    MPICH's Hydra, having passed a SIGTERM on, may report the ranks' 75 as 0), and, from a
    launcher that names it (``outcome.NamesFailedHost``), the first failed rank's host, which a
    restart runs without. The one reader of the marker.

    The marker is removed before each attempt starts (the one before it has ended), so one
    found at its end was written during it: no clock is compared (a file system's clock may
    lag this machine's, or run ahead of it)."""

    attempts: Attempts
    run_folder: Path
    #: Each ended attempt's outcome, in order.
    outcomes: list[Outcome] = field(default_factory=list)

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> Sequence[subprocess.Popen]:
        marker = self.run_folder / PREEMPTED_MARKER
        try:
            marker.unlink(missing_ok=True)
        except OSError as exc:  # left there, it would read every end of the attempt as a stop
            raise UserError(f"cannot remove the preempted marker {marker} before the ranks start: "
                            f"{exc.strerror or exc}") from None
        previous = self.outcomes[-1] if self.outcomes and self.outcomes[-1].attempt == attempt - 1 else None
        left_out = previous.left_out if previous is not None else None
        if left_out is not None and isinstance(self.attempts, NamesFailedHost):
            self.attempts.run_without(left_out)
        return self.attempts.start(attempt, extra_env)

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        self.attempts.forward_stop(signum, children)

    def read_status(self, attempt: int, status: int) -> int:
        return self.read_outcome(attempt, status).status

    def read_outcome(self, attempt: int, status: int) -> Outcome:
        status = self.attempts.read_status(attempt, status)
        names = self.attempts if isinstance(self.attempts, NamesFailedHost) else None
        outcome = attempt_outcome(attempt, status, preempted=(self.run_folder / PREEMPTED_MARKER).exists(),
                                  failed=names.failed_rank(attempt) if names is not None else None,
                                  spare=names is not None and names.has_spare)
        self.outcomes.append(outcome)
        return outcome

    def describe(self) -> str:
        return self.attempts.describe()

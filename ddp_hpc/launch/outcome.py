"""What an attempt ended as, and why: the one place that decides it.

An attempt (all ranks of one start of the command) ends as one of three ``Ended``:

- **finished**: every rank exited 0;
- **stopped**: the ranks checkpointed on request and exited 75 (``ExitStatus.REQUEUE``), or
  rank 0 left the preempted marker in the run folder whatever the launcher says (srun's
  ``--kill-on-bad-exit`` reports the stop as a kill, MPICH's Hydra may report it as 0);
- **failed**: anything else, with the first rank that failed and its host where the launcher
  names them, and the host the next attempt runs without where the launch has a spare one.

``attempt_outcome`` makes the ``Outcome`` from the launcher's status, the marker and that
evidence; what follows is asked of others: the restart policy (``restart.RestartPolicy``)
decides from its status, ``left_out.leave_out`` records its left-out host when a restart runs
without it, ``restart.LaunchEnd``/``record_exit`` write the exit file. Who makes one:
``attempts.MarkedAttempts`` for ``ddp-hpc launch`` (the only reader of the marker) and a
submitit command job's task (``schedulers/slurm/in_job.py``).

The evidence of which rank failed, and where, one reader per launcher:

- mpiexec (``--hostfile``): ``failed_rank_in_file``, the ``rank-failures-<attempt>`` file the
  rank wrapper (``script.RANK_FAILURE_WRAPPER``) writes, in the order the ranks failed;
- srun: ``failed_rank_in_srun_line``, srun's ``srun: error: NODE: task N: ...`` line;
- a rank that watches its own command (a submitit task): ``failed_rank_here``, this node.
"""

from __future__ import annotations

import enum
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from ddp_hpc.contract import RANK_FAILURES_PREFIX, ExitStatus
from ddp_hpc.launch.left_out import LeftOutHost


class Ended(enum.Enum):
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class FailedRank:
    """The first rank (or task: a node supervisor) that failed, where it ran, and why in the
    words ``ddp-hpc status`` shows (``rank 1 exited with status 137``)."""

    host: str | None
    reason: str
    rank: int | None = None


@dataclass(frozen=True)
class Outcome:
    """What attempt ``attempt`` (0 first) ended as: ``status`` is the one the restart policy
    sees (75 for every stop)."""

    attempt: int
    ended: Ended
    status: int
    #: Failed only: the first failed rank, where the launcher names it.
    failed: FailedRank | None = None
    #: Failed only: the host a restart runs without (the failed rank's, where the launch has a spare).
    left_out: LeftOutHost | None = None


def attempt_outcome(attempt: int, status: int, *, preempted: bool = False, failed: FailedRank | None = None,
                    spare: bool = False) -> Outcome:
    """The one decision: attempt ``attempt`` ended with the launcher's ``status``;
    ``preempted``: the marker was found (written during this attempt: it is cleared before
    each); ``failed``: the evidence of the first failed rank; ``spare``: the launch can start
    the next attempt without that rank's host."""
    if preempted or status == ExitStatus.REQUEUE:
        return Outcome(attempt, Ended.STOPPED, ExitStatus.REQUEUE)
    if status == ExitStatus.OK:
        return Outcome(attempt, Ended.FINISHED, ExitStatus.OK)
    if status == ExitStatus.USAGE or refused_on_rank(failed):  # no host is at fault: none is left out
        return Outcome(attempt, Ended.FAILED, ExitStatus.USAGE, failed)
    left_out = (LeftOutHost(failed.host, attempt, failed.reason)
                if spare and failed is not None and failed.host else None)
    return Outcome(attempt, Ended.FAILED, status, failed, left_out)


#: The endings of a failed rank's evidence that say it exited 2 (it refused the user's mistake
#: in one line): srun's ``task N: Exited with exit code 2``, the rank wrapper's and a task's own
#: ``rank N exited with status 2``.
USAGE_REASONS = (f"Exited with exit code {ExitStatus.USAGE:d}", f"exited with status {ExitStatus.USAGE:d}")


def refused_on_rank(failed: FailedRank | None) -> bool:
    """The first failed rank exited 2, whatever status its launcher reports for the attempt
    (srun reports its tasks' highest: the 137 of a task ``--kill-on-bad-exit`` ended; mpiexec may too)."""
    return failed is not None and failed.reason.endswith(USAGE_REASONS)


@runtime_checkable
class NamesFailedHost(Protocol):
    """``Attempts`` whose launcher says where the first failed rank ran, and which can start
    the next attempt without that host (``hosts.HostfileAttempts``, ``srun.SrunSteps``)."""

    @property
    def has_spare(self) -> bool:
        """Whether a restart can run without a host (spares, and restarts, are left)."""

    def failed_rank(self, attempt: int) -> FailedRank | None:
        """The first failed rank of attempt ``attempt``, which has ended; None: not named."""

    def run_without(self, host: LeftOutHost) -> None:
        """The next attempt runs without ``host``."""


def failed_rank_in_file(run_folder: Path, attempt: int, hosts: Sequence[str], tasks_per_host: int,
                        task: str = "rank") -> FailedRank | None:
    """The first line of ``RUN/rank-failures-<attempt>`` (``TASK STATUS``), the task's host
    from the attempt's ``hosts`` (``tasks_per_host`` tasks each, in order); ``task`` names
    what a task is in the reason (``rank``, or ``the node supervisor of host``)."""
    try:
        first = (run_folder / f"{RANK_FAILURES_PREFIX}{attempt}").read_text().split("\n")[0]
    except OSError:
        return None
    index, _, status = first.partition(" ")
    if not index.isdigit() or int(index) // tasks_per_host >= len(hosts):
        return None
    return FailedRank(hosts[int(index) // tasks_per_host], f"{task} {index} exited with status {status.strip()}",
                      int(index))


#: srun's line for a task that failed: the node comes first.
_SRUN_FAILED_TASK = re.compile(r"^srun: error: ([^:\s]+): task ([0-9]+)")


def failed_rank_in_srun_line(line: str) -> FailedRank | None:
    """``srun: error: NODE: task N: ...`` (a line of srun's stderr) -> task N on NODE, the line as
    the reason; None for any other line."""
    match = _SRUN_FAILED_TASK.match(line)
    return FailedRank(match.group(1), line, int(match.group(2))) if match is not None else None


def failed_rank_here(rank: int, returncode: int, environ: Mapping[str, str]) -> FailedRank:
    """Rank ``rank``, whose command this process ran, ended with ``returncode``: on this node
    (SLURM's name for it, else the host's)."""
    host = environ.get("SLURMD_NODENAME") or socket.gethostname()
    return FailedRank(host, f"rank {rank} exited with status {ExitStatus.of_returncode(returncode):d}", rank)

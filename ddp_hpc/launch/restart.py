"""The one restart policy: what an attempt's exit status means for the launch.

Every path that restarts or requeues asks it: ``ddp-hpc launch`` (its supervisor, under each
launcher, over a hostfile and in srun steps; every rendered PBS, SLURM and local script ends
in that launch) and a submitit command job. docs/reliability.md has the table.

- 0 ends the launch.
- ``ExitStatus.REQUEUE`` (75) is a stop on request (a signal, the job's deadline): the ranks
  checkpointed. Never restarted in place: handed back as 75 to whatever started the launch,
  which requeues it (a batch script) or runs it again later (a user).
- ``ExitStatus.USAGE`` (2) is the user's mistake, refused in one line (a bad input, a
  ``RefusedOnRank``): never restarted, for a restart meets the same mistake; handed back as 2.
- Anything else is a failure: restarted up to ``max_restarts`` times, resuming from the
  newest checkpoint; the last failure's status is handed back.
- Once a stop was requested (a stop signal reached the launch), nothing is restarted, and a
  launch that can requeue does so unless the ranks finished (0).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import AGREED_EXIT_STATUSES, ExitStatus, atomic_write, exit_file_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """Restart the ranks, or end the launch with ``status`` (and ask for a requeue, where the
    launch has one)."""

    restart: bool
    status: int
    requeue: bool = False


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0

    def decide(self, status: int, attempt: int, stop_requested: bool = False) -> Decision:
        """What follows attempt ``attempt`` (0 first) that ended with ``status``."""
        if status == ExitStatus.USAGE:
            if attempt < self.max_restarts and not stop_requested:
                log.error("the ranks exited %d (the user's mistake, said in one line above): not restarted, a "
                          "restart would meet the same mistake", status)
            return Decision(restart=False, status=status)
        if status in AGREED_EXIT_STATUSES or stop_requested or attempt >= self.max_restarts:
            requeue = status == ExitStatus.REQUEUE or (stop_requested and status != ExitStatus.OK)
            return Decision(restart=False, status=status, requeue=requeue)
        return Decision(restart=True, status=status)


def record_exit(run_folder: Path, job_id: str, status: int) -> None:
    """The job's exit status in ``RUN/exit-<job id>``, for ``--wait`` and ``status``: the one
    writer of exit files. A rendered script whose job ends before its launch starts (a failed
    staging or pre-flight) calls it through ``ddp-hpc record-exit`` (``script.py``), and
    writes the file itself only where ddp-hpc cannot start."""
    try:
        atomic_write(run_folder / exit_file_name(job_id), f"{status}\n")
    except OSError as exc:
        log.error("cannot write the exit status to %s: %s", run_folder, exc.strerror or exc)


def requeue_job(argv: Sequence[str], job_id: str) -> bool:
    """Requeue the job with the scheduler's command (``scontrol requeue ID``): the one requeue
    path of a launch and of a submitit command job. True when the scheduler took it."""
    log.warning("requeueing job %s", job_id)
    try:
        done = subprocess.run(list(argv), check=False).returncode == 0
    except OSError:
        done = False
    if not done:
        log.error("requeue failed")
    return done


@dataclass(frozen=True)
class LaunchEnd:
    """A launch's one end action, after the policy's last decision: the job requeued after a
    stop where the launch can (``requeue``: the scheduler's command, ``scontrol requeue ID``),
    else its exit status written as ``RUN/exit-<job_id>`` where it has a job id."""

    run_folder: Path | None = None
    job_id: str = ""
    requeue: tuple[str, ...] = ()

    def __call__(self, decision: Decision) -> int:
        if self.requeue and decision.requeue:
            requeue_job(self.requeue, self.job_id)
        elif self.job_id and self.run_folder is not None:
            record_exit(self.run_folder, self.job_id, decision.status)
        return decision.status

"""A SLURM job's state, from whichever source answers: sacct, scontrol, squeue, then the
exit file the batch script wrote. Clusters without accounting (no ``sacct``, or a broken
one) still report the end: torchx added the same fallback for the same reason."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_hpc.schedulers.base import JobState, JobStatus, query_tool, read_exit_file, run_tool
from ddp_hpc.contract.slurm_job_key import element_key

if TYPE_CHECKING:
    from ddp_hpc.specs.request import SubmitRequest

log = logging.getLogger(__name__)

#: SLURM's job states (``man squeue``, JOB STATE CODES) onto ours.
SLURM_STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.PENDING,
    "PREEMPTED": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "COMPLETED": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "DEADLINE": JobState.TIMEOUT,
    "TIMEOUT": JobState.TIMEOUT,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,
}


def _state(word: str) -> JobState:
    return SLURM_STATES.get(word.split()[0].rstrip("+").upper(), JobState.UNKNOWN) if word.strip() else JobState.UNKNOWN


def _exit_code(text: str) -> int | None:
    """``0:0`` (status:signal) -> 0; a signal counts as 128 + its number, like a shell."""
    code, _, signal = text.strip().partition(":")
    if not code.isdigit():
        return None
    return 128 + int(signal) if signal.isdigit() and int(signal) and not int(code) else int(code)


def from_sacct(job_id: str) -> JobStatus | None:
    out = query_tool(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])
    rows = [line.split("|") for line in (out or "").splitlines() if line.strip()]
    if not rows:
        return None
    state, code = rows[0][0], rows[0][1] if len(rows[0]) > 1 else ""
    return JobStatus(_state(state), _exit_code(code), state, "sacct")


def from_scontrol(job_id: str) -> JobStatus | None:
    out = query_tool(["scontrol", "show", "job", "-o", job_id])
    if not out:
        return None
    fields = dict(part.split("=", 1) for part in out.split() if "=" in part)
    state = fields.get("JobState", "")
    return JobStatus(_state(state), _exit_code(fields.get("ExitCode", "")), state, "scontrol") if state else None


def from_squeue(job_id: str) -> JobStatus | None:
    out = query_tool(["squeue", "-h", "-j", job_id, "-o", "%T"])
    state = (out or "").strip().splitlines()
    return JobStatus(_state(state[0]), None, state[0], "squeue") if state else None


def slurm_status(job_id: str, exit_file: Path | None) -> JobStatus:
    for source in (from_sacct, from_scontrol, from_squeue):
        status = source(job_id)
        if status is not None and status.state is not JobState.UNKNOWN:
            return status
    code = read_exit_file(exit_file) if exit_file else None
    if code is not None:
        return JobStatus(JobState.COMPLETED if code == 0 else JobState.FAILED, code, f"exit {code}", "exit file")
    return JobStatus(JobState.UNKNOWN)


class SlurmJobs:
    """What both SLURM backends (sbatch, submitit) answer alike: the launchers a profile may
    name, a job's state, an array element's id, and cancelling."""

    launchers = ("srun", "torchrun")
    #: The profile launchers that start one torchrun per node (the rest: srun per rank).
    per_node = ("torchrun",)
    #: Accepted in a SLURM profile, but never rendered: srun starts the ranks (said in one line).
    srun_instead = ("mpich", "openmpi")

    def check_launcher(self, request: SubmitRequest) -> None:
        launcher = request.profile.launcher
        if launcher in self.srun_instead:
            log.warning("cluster profile %r: launcher: %s is not how SLURM scripts start ranks: srun starts them "
                        "(set launcher: srun)", request.profile.name, launcher)
            return
        super().check_launcher(request)  # type: ignore[misc]  (a mixin before Scheduler)

    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        return slurm_status(job_id, exit_file)

    def element_id(self, job_id: str, index: int) -> str:
        return element_key(job_id, index)

    @classmethod
    def torchrun_per_node(cls, request: SubmitRequest) -> bool:
        """One torchrun per node (``--torchrun``, or the profile's ``launcher: torchrun``)."""
        return request.torchrun_per_node or request.profile.launcher in cls.per_node

    def cancel_jobs(self, job_ids: Sequence[str]) -> None:
        run_tool(["scancel", *job_ids], "scancel cancels SLURM jobs")

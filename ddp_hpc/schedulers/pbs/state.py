"""A PBS job's state: ``qstat``'s one-letter states through one table, then the exit file
the rendered script wrote."""

from __future__ import annotations

from pathlib import Path

from ddp_hpc.schedulers.base import JobState, JobStatus, query_tool, read_exit_file

#: ``qstat``'s one-letter job states (PBS Pro reference guide, "Job states") onto ours.
#: F (finished) and X (subjob done) say nothing about success: the exit status decides.
PBS_STATES: dict[str, JobState] = {
    "Q": JobState.PENDING,
    "H": JobState.PENDING,
    "W": JobState.PENDING,
    "T": JobState.PENDING,
    "M": JobState.PENDING,
    "R": JobState.RUNNING,
    "B": JobState.RUNNING,
    "E": JobState.RUNNING,
    "S": JobState.RUNNING,
    "U": JobState.RUNNING,
    "F": JobState.COMPLETED,
    "X": JobState.COMPLETED,
    "C": JobState.COMPLETED,
}


def qstat_letter(job_id: str) -> str | None:
    """The job's state letter in ``qstat`` (``-t`` for an array's subjob); None where qstat
    does not know the job."""
    out = query_tool(["qstat", "-t", job_id] if "[" in job_id else ["qstat", job_id])
    for line in (out or "").splitlines():
        fields = line.split()
        if fields and fields[0].split(".")[0] == job_id.split(".")[0] and len(fields) >= 5:
            return fields[4]
    return None


def pbs_status(job_id: str, exit_file: Path) -> JobStatus:
    """qstat while the job is queued or running; then the exit file the script wrote."""
    code = read_exit_file(exit_file)
    letter = qstat_letter(job_id)
    if letter is not None and PBS_STATES.get(letter) in (JobState.PENDING, JobState.RUNNING):
        return JobStatus(PBS_STATES[letter], None, letter, "qstat")
    if code is not None:
        return JobStatus(JobState.COMPLETED if code == 0 else JobState.FAILED, code, f"exit {code}", "exit file")
    if letter is not None and letter in PBS_STATES:
        # Finished, but the script never wrote its exit status: it was killed (walltime,
        # qdel, a node failure) before its last line.
        return JobStatus(JobState.FAILED, None, f"{letter} (no exit status recorded)", "qstat")
    return JobStatus(JobState.UNKNOWN)

"""PBS Pro (Aurora, Polaris, generic sites) through a rendered script and ``qsub``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddp_hpc.errors import UserError
from ddp_hpc.launch.pbs import render_pbs
from ddp_hpc.launch.request import JobRequest, job_name_directive
from ddp_hpc.launch.schedulers.base import (
    DryRun,
    JobState,
    JobStatus,
    RunOpt,
    ScriptScheduler,
    query_tool,
    read_exit_file,
    run_tool,
)

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


def _qstat_letter(job_id: str) -> str | None:
    out = query_tool(["qstat", "-t", job_id] if "[" in job_id else ["qstat", job_id])
    for line in (out or "").splitlines():
        fields = line.split()
        if fields and fields[0].split(".")[0] == job_id.split(".")[0] and len(fields) >= 5:
            return fields[4]
    return None


class PbsScheduler(ScriptScheduler):
    name = "pbs"
    family = "pbs"
    script_suffix = ".pbs"
    tool = "qsub"
    where = "PBS"
    run_opts = (
        RunOpt(("--spare-nodes",), "request K extra nodes; a restart (--max-restarts) runs mpiexec without the "
               "node where a rank failed first", "job", {"type": int, "default": 0, "metavar": "K"}),
    )

    def render(self, request: JobRequest) -> str:
        return render_pbs(request)

    def submit_argv(self, script_path: Path) -> list[str]:
        return ["qsub", str(script_path)]

    def after(self, job_id: str) -> list[str]:
        return ["-W", f"depend=afterany:{job_id}"]

    def log_paths(self, dry_run: DryRun, job_ids: Sequence[str]) -> list[Path]:
        # PBS Pro writes NAME.oNUMBER in the submit folder (-j oe merges stderr into it);
        # Slurm's qsub wrapper ignores -N and -j for this: SCRIPT.oNUMBER and SCRIPT.eNUMBER,
        # and SCRIPT.oNUMBER.INDEX for array elements.
        numbers = [job_id.split(".")[0].replace("[]", "") for job_id in job_ids]
        stems = dict.fromkeys((job_name_directive(dry_run.request.name), dry_run.script_path.name))
        suffixes = [f".{e.index}" for e in dry_run.request.elements] or [""]
        return [dry_run.workdir / f"{stem}.{kind}{number}{suffix}" for number in numbers for stem in stems
                for kind in ("o", "e") for suffix in suffixes]

    def element_id(self, job_id: str, index: int) -> str:
        """PBS Pro names subjobs ``123[4].server``; Slurm's qsub wrapper ``123_4``."""
        return job_id.replace("[]", f"[{index}]") if "[]" in job_id else f"{job_id}_{index}"

    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        code = read_exit_file(exit_file)
        letter = _qstat_letter(job_id)
        if letter is not None and PBS_STATES.get(letter) in (JobState.PENDING, JobState.RUNNING):
            return JobStatus(PBS_STATES[letter], None, letter, "qstat")
        if code is not None:
            return JobStatus(JobState.COMPLETED if code == 0 else JobState.FAILED, code, f"exit {code}", "exit file")
        if letter is not None and letter in PBS_STATES:
            # Finished, but the script never wrote its exit status: it was killed (walltime,
            # qdel, a node failure) before its last line.
            return JobStatus(JobState.FAILED, None, f"{letter} (no exit status recorded)", "qstat")
        return JobStatus(JobState.UNKNOWN)

    def cancel_jobs(self, job_ids) -> None:
        run_tool(["qdel", *job_ids], "qdel cancels PBS jobs")

"""PBS Pro (Aurora, Polaris, generic sites) through a rendered script and ``qsub``."""

from __future__ import annotations

from pathlib import Path

from ddp_hpc.launch.pbs import render_pbs
from ddp_hpc.launch.request import JobRequest, job_name_directive
from ddp_hpc.launch.schedulers.base import (
    DryRun,
    JobState,
    JobStatus,
    Scheduler,
    Submission,
    query_tool,
    read_exit_file,
    run_tool,
    write_script,
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


class PbsScheduler(Scheduler):
    name = "pbs"
    family = "pbs"
    script_suffix = ".pbs"

    def dry_run(self, request: JobRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        self.check_profile(request)
        script_path = script_path or workdir / request.run_folder / f"job{self.script_suffix}"
        return DryRun(self.name, request, workdir, tuple(request.rank_command()), script=render_pbs(request),
                      script_path=script_path, submit_argv=("qsub", str(script_path)))

    def submit(self, dry_run: DryRun) -> Submission:
        write_script(dry_run.script, dry_run.script_path)
        hint = (f"the rendered script is at {dry_run.script_path}; submit it where PBS runs: "
                f"qsub {dry_run.script_path}")
        job_ids: list[str] = []
        for _ in range(dry_run.request.chain):
            argv = list(dry_run.submit_argv)
            if job_ids:
                argv[-1:-1] = ["-W", f"depend=afterany:{job_ids[-1]}"]
            job_ids.append(run_tool(argv, hint, cwd=dry_run.workdir).strip())
        numbers = [job_id.split(".")[0].replace("[]", "") for job_id in job_ids]
        # PBS Pro writes NAME.oNUMBER in the submit folder (-j oe merges stderr into it);
        # Slurm's qsub wrapper ignores -N and -j for this: SCRIPT.oNUMBER and SCRIPT.eNUMBER.
        name, script = job_name_directive(dry_run.request.name), dry_run.script_path.name
        # Array elements: NAME.oNUMBER.INDEX (PBS Pro: NAME.oNUMBER^INDEX^ is not used here).
        suffixes = [f".{e.index}" for e in dry_run.request.elements] or [""]
        logs = [str(dry_run.workdir / f"{stem}.{kind}{number}{suffix}") for number in numbers
                for stem in dict.fromkeys((name, script)) for kind in ("o", "e") for suffix in suffixes]
        return self._submission(dry_run, job_ids, logs, dry_run.submit_argv)

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

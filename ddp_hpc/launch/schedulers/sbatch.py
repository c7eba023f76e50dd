"""SLURM through a rendered batch script and ``sbatch`` (srun per rank, or torchrun per node)."""

from __future__ import annotations

from pathlib import Path

from ddp_hpc.launch.request import JobRequest
from ddp_hpc.launch.schedulers.base import DryRun, JobStatus, Scheduler, Submission, run_tool, write_script
from ddp_hpc.launch.schedulers.slurm_state import slurm_status
from ddp_hpc.launch.slurm import LOG_DIR, render_sbatch


class SbatchScheduler(Scheduler):
    name = "sbatch"
    family = "slurm"
    script_suffix = ".sbatch"

    def dry_run(self, request: JobRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        self.check_profile(request)
        script_path = script_path or workdir / request.run_folder / f"job{self.script_suffix}"
        return DryRun(self.name, request, workdir, tuple(request.rank_command()), script=render_sbatch(request),
                      script_path=script_path, submit_argv=("sbatch", "--parsable", str(script_path)))

    def submit(self, dry_run: DryRun) -> Submission:
        write_script(dry_run.script, dry_run.script_path)
        (dry_run.workdir / LOG_DIR).mkdir(exist_ok=True)
        hint = (f"the rendered script is at {dry_run.script_path}; submit it where SLURM runs: "
                f"sbatch {dry_run.script_path}")
        job_id = run_tool(dry_run.submit_argv, hint, cwd=dry_run.workdir).split(";")[0].strip()
        log = dry_run.workdir / LOG_DIR / f"{_job_name(dry_run)}-{job_id}.out"
        return self._submission(dry_run, job_id, [str(log)], dry_run.submit_argv)

    def status(self, submission: Submission) -> JobStatus:
        return slurm_status(submission.job_id, submission.exit_file)

    def cancel(self, submission: Submission) -> None:
        run_tool(["scancel", submission.job_id], "scancel cancels SLURM jobs")


def _job_name(dry_run: DryRun) -> str:
    from ddp_hpc.launch.request import job_name_directive

    return job_name_directive(dry_run.request.name)

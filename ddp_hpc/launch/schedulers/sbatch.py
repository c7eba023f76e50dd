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
        job_ids: list[str] = []
        for _ in range(dry_run.request.chain):
            argv = list(dry_run.submit_argv)
            if job_ids:
                argv[-1:-1] = [f"--dependency=afterany:{job_ids[-1]}"]
            job_ids.append(run_tool(argv, hint, cwd=dry_run.workdir).split(";")[0].strip())
        name = _job_name(dry_run)
        if dry_run.request.sweep is not None:
            logs = [str(dry_run.workdir / LOG_DIR / f"{name}-{job_ids[0]}_{e.index}.out") for e in dry_run.request.elements]
        else:
            logs = [str(dry_run.workdir / LOG_DIR / f"{name}-{job_id}.out") for job_id in job_ids]
        return self._submission(dry_run, job_ids, logs, dry_run.submit_argv)

    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        return slurm_status(job_id, exit_file)

    def cancel_jobs(self, job_ids) -> None:
        run_tool(["scancel", *job_ids], "scancel cancels SLURM jobs")


def _job_name(dry_run: DryRun) -> str:
    from ddp_hpc.launch.request import job_name_directive

    return job_name_directive(dry_run.request.name)

"""SLURM through submitit: one task per rank running a pickled Python callable (the
callables are in ``in_job.py``).

submitit owns SIGUSR2 in its tasks: on the time-limit warning or preemption it calls the
callable's ``checkpoint()`` and requeues the job with what that returns.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

from ddp_hpc.errors import UserError
from ddp_hpc.specs.request import CommandPayload, SubmitRequest, TrainPayload, export_lines, parse_walltime
from ddp_hpc.schedulers.base import DryRun, Scheduler, Submission, run_tool
from ddp_hpc.schedulers.slurm.in_job import Resubmission, SubmititCommandTask, SubmititTrainTask, submitit_logs
from ddp_hpc.schedulers.slurm.render import SLURM_DEADLINE_LINES
from ddp_hpc.schedulers.slurm.state import SlurmJobs

log = logging.getLogger(__name__)


def executor_parameters(request: SubmitRequest) -> dict[str, Any]:
    profile = request.profile
    _, minutes = parse_walltime(request.walltime)
    params: dict[str, Any] = {
        "name": request.name, "nodes": request.nodes, "tasks_per_node": request.per_node,
        "timeout_min": minutes, "slurm_signal_delay_s": request.stop_signal.lead_s,
        "slurm_setup": [*request.setup_lines(), *export_lines(request.environment()), *SLURM_DEADLINE_LINES],
    }
    if profile.cpus_per_task:
        params["cpus_per_task"] = profile.cpus_per_task
    if profile.uses_gpus and profile.devices_per_node:
        params["gpus_per_node"] = request.per_node
    if request.resolved_queue:
        params["slurm_partition"] = request.resolved_queue
    if request.resolved_account:
        params["slurm_account"] = request.resolved_account
    return params


class SubmititScheduler(SlurmJobs, Scheduler):
    name = "submitit"
    family = "slurm"

    def dry_run(self, request: SubmitRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        self.check_profile(request)
        if request.torchrun_per_node:
            raise UserError("--torchrun renders a batch script: use it with --sbatch")
        if self.torchrun_per_node(request):  # the profile's launcher: torchrun, not --torchrun
            log.warning("cluster profile %r: launcher: torchrun starts one torchrun per node from a batch script "
                        "(--sbatch); submitit starts one srun task per rank", request.profile.name)
        if request.recover:
            raise UserError("--recover runs the ranks under ddp-hpc launch's node supervisors in a batch script: use "
                            "it with --sbatch")
        if request.spare_nodes:
            raise UserError("--spare-nodes allocates nodes for a batch script's restarts: use it with --sbatch "
                            "(submitit's --max-restarts submits the job again without the failed node)")
        if request.max_restarts and (request.elements or request.chain > 1):
            raise UserError("--max-restarts under submitit submits one job again: for a sweep or a chain use --sbatch")
        if request.preflight:
            raise UserError("--preflight runs a step before the ranks in a batch script: use it with --sbatch")
        if request.stage_env:
            raise UserError("--stage-env copies the environment in a step before the ranks in a batch script: use it "
                            "with --sbatch")
        if request.stop_signal.name != "USR2":
            raise UserError(f"--signal {request.stop_signal}: submitit's tasks take SIGUSR2 only; give USR2@SECONDS, "
                            "or use --sbatch")
        parameters = executor_parameters(request)
        if request.sweep is not None and request.sweep.limit:
            parameters["slurm_array_parallelism"] = request.sweep.limit
        return DryRun(self.name, request, workdir, tuple(request.rank_command()), parameters=parameters)

    def folder(self, dry_run: DryRun) -> Path:
        return dry_run.run_folder / "submitit"

    def tasks(self, dry_run: DryRun) -> list:
        """One callable, or one per sweep element (submitted as one array job)."""
        request, workdir = dry_run.request, str(dry_run.workdir)
        if request.max_restarts:
            # The task must outlive its rank to submit the job again without the rank's node: a
            # training config runs as a command job then (`ddp-hpc train` as each task's child).
            restart = Resubmission(dict(dry_run.parameters), str(self.folder(dry_run)), request.max_restarts)
            return [SubmititCommandTask(self.command_payload(request.payload), workdir, str(dry_run.run_folder),
                                        restart=restart)]
        if isinstance(request.payload, CommandPayload):
            if not request.elements:
                return [SubmititCommandTask(request.payload, workdir, str(dry_run.run_folder))]
            return [SubmititCommandTask(request.payload, workdir, str(dry_run.workdir / request.element_run_folder(e)),
                                        e.environment()) for e in request.elements]
        payloads = [request.element_payload(e) for e in request.elements] or [request.payload]
        return [SubmititTrainTask(payload, workdir, requeue=request.chain == 1) for payload in payloads]

    @staticmethod
    def command_payload(payload: CommandPayload | TrainPayload) -> CommandPayload:
        """A training config as the command each rank runs: ``ddp-hpc train`` of the
        submitting Python, which submitit's tasks run too."""
        if isinstance(payload, CommandPayload):
            return payload
        return CommandPayload(tuple(payload.rank_command((sys.executable, "-m", "ddp_hpc"))))

    def submit(self, dry_run: DryRun) -> Submission:
        import submitit

        run_tool(["sbatch", "--version"], "submitit submits through SLURM's sbatch")
        folder = self.folder(dry_run)
        executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
        executor.update_parameters(**dry_run.parameters)
        tasks = self.tasks(dry_run)
        if dry_run.request.sweep is not None:
            jobs = executor.submit_array(tasks)
            # submitit names the elements ARRAYID_INDEX, as ``element_id`` does.
            return self._submission(dry_run, [jobs[0].job_id.split("_")[0]], self._logs(folder, jobs, 1),
                                    ("submitit", "sbatch", "--array"))
        job_ids: list[str] = []
        jobs = []
        for _ in range(dry_run.request.chain):
            if job_ids:
                executor.update_parameters(slurm_additional_parameters={"dependency": f"afterany:{job_ids[-1]}"})
            jobs.append(executor.submit(tasks[0]))
            job_ids.append(jobs[-1].job_id)
        return self._submission(dry_run, job_ids, self._logs(folder, jobs, dry_run.request.world_size),
                                ("submitit", "sbatch"))

    @staticmethod
    def _logs(folder: Path, jobs, ranks: int) -> list[str]:
        return submitit_logs(folder, [job.job_id for job in jobs], ranks)

    def failure(self, submission: Submission) -> str | None:
        """Why a finished job failed, from submitit's result files (None if every rank
        returned a result)."""
        import submitit

        if submission.elements:
            return None  # each element's state says it; see ``ddp-hpc status`` per element
        folder = Path(submission.run_folder) / "submitit"
        job = submitit.SlurmJob(folder=str(folder), job_id=submission.job_id, tasks=range(submission.world_size))
        try:
            job.results()
        except Exception as exc:  # submitit raises with one failing task's traceback
            return submitit_failure(submission.job_id, submission.world_size, folder, str(exc))
        return None


_EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*)$")


def submitit_failure(job_id: str, world_size: int, folder: Path, error: str) -> str:
    """One line on a failed submitit job: the ranks that died without a result (a SIGKILL,
    the OOM killer: they could not report), then what a surviving rank raised."""
    silent = [rank for rank in range(world_size) if not (folder / f"{job_id}_{rank}_result.pkl").exists()]
    raised = [m.group(1) for m in map(_EXCEPTION_LINE.match, error.splitlines()) if m]
    parts = []
    if silent:
        parts.append(f"rank(s) {', '.join(map(str, silent))} ended without a result (killed, e.g. by SIGKILL "
                     f"or the OOM killer)")
    if raised:
        parts.append(f"another rank raised {raised[-1][:200]}")
    return f"job {job_id} failed: {'; '.join(parts) or 'see the logs'}; logs in {folder}"

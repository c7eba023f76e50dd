"""SLURM through submitit: one task per rank running a pickled Python callable.

submitit owns SIGUSR2 in its tasks: on the time-limit warning or preemption it calls the
callable's ``checkpoint()`` and requeues the job with what that returns.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from ddp_hpc.contract import ExitStatus, atomic_write, exit_file_name
from ddp_hpc.errors import UserError
from ddp_hpc.launch.request import CommandPayload, JobRequest, TrainPayload, export_lines, parse_walltime
from ddp_hpc.launch.schedulers.base import (
    DryRun,
    JobStatus,
    Scheduler,
    Submission,
    run_tool,
)
from ddp_hpc.launch.schedulers.slurm_state import slurm_status
from ddp_hpc.stop import SLURM_DEADLINE_LINES

log = logging.getLogger(__name__)

#: How long a command job's checkpoint() waits for the command to stop, at most.
COMMAND_STOP_WAIT_S = 80


class SubmititTrainTask:
    """What each SLURM task runs for a training config: ``train`` on this rank.

    submitit's own handler for its signal (SIGUSR2) would requeue at once, killing the
    ranks wherever they are. Instead the ranks take the signal as under sbatch: they agree
    on a step, checkpoint there and stop; only then is submitit's handler called, which
    calls ``checkpoint`` and requeues. A stop for the job's deadline is handed over the
    same way. After SIGTERM (scancel, preemption; submitit ignores it) the ranks stop
    and the scheduler decides what comes next.
    """

    def __init__(self, payload: TrainPayload, workdir: str, requeue: bool = True) -> None:
        self.payload, self.workdir = payload, workdir
        #: Off in a chain: the next link resumes the run, a requeue would run it twice.
        self.requeue = requeue

    def __call__(self) -> dict[str, Any]:
        from ddp_hpc.training.run_on_rank import TrainOptions, train

        os.chdir(self.workdir)
        options = TrainOptions(configure_logs=True, handle_signals=True)
        summary = train(self.payload.config_path, self.payload.overrides, options=options)
        if not summary.preempted:
            return summary.to_dict()
        if not self.requeue:  # a chain's next link continues the run
            raise SystemExit(summary.exit_status)
        hand_over_to_submitit(signal.Signals[summary.stopped_by] if summary.stopped_by else None)

    def checkpoint(self, *args: Any, **kwargs: Any):
        import submitit

        # Requeued with the same task: it resumes from the run's newest checkpoint (resume: auto).
        if not self.requeue:
            return None
        return submitit.helpers.DelayedSubmission(SubmititTrainTask(self.payload, self.workdir))


class SubmititCommandTask:
    """What each SLURM task runs for a command job: the command, as a child with torchrun's
    variables. A child that exits with ``ExitStatus.REQUEUE`` (checkpointed on request) gets the
    job requeued."""

    def __init__(self, payload: CommandPayload, workdir: str, run_folder: str,
                 extra_env: dict[str, str] | None = None) -> None:
        self.payload, self.workdir, self.run_folder = payload, workdir, run_folder
        self.extra_env = dict(extra_env or {})  # a sweep element's variables
        self._child: subprocess.Popen | None = None

    def __call__(self) -> int:
        from ddp_hpc.api import command_environment

        os.chdir(self.workdir)
        launch = command_environment(self.payload.argv)
        sys.stdout.flush()
        self._child = subprocess.Popen(list(launch.argv), env={**launch.environment(os.environ), **self.extra_env})
        code = self._child.wait()
        rank = int(launch.environment(os.environ).get("RANK", "0"))
        job_id = _slurm_job_key()
        if rank == 0 and job_id and code != ExitStatus.REQUEUE:
            Path(self.run_folder).mkdir(parents=True, exist_ok=True)
            atomic_write(Path(self.run_folder) / exit_file_name(job_id), f"{code}\n")
        if code == ExitStatus.REQUEUE:
            requeue_from_rank_zero()  # the command checkpointed and asked to be run again
        if code != 0:
            raise RuntimeError(f"command {self.payload.describe()!r} exited with status {code} on rank {rank}")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any):
        """submitit's time-limit/preemption hook: pass the signal on, let the command
        checkpoint and exit, then requeue the same task."""
        import submitit

        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signal.SIGUSR2)
            try:
                self._child.wait(timeout=COMMAND_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        return submitit.helpers.DelayedSubmission(
            SubmititCommandTask(self.payload, self.workdir, self.run_folder, self.extra_env))


#: How long the other ranks wait for rank 0's requeue to end them.
REQUEUE_WAIT_S = 120.0


def hand_over_to_submitit(signum: int | None) -> NoReturn:
    """After the agreed-step checkpoint: let submitit do what its signal handler is for.

    Every rank calls submitit's handler for its preemption signal (now restored): rank 0's
    calls ``checkpoint()``, requeues the job and exits; the others' only log. They then
    wait to be ended by the requeue rather than exit first (a task that ends with an error
    would report the job as failed, and ``--kill-on-bad-exit`` would stop the requeue).
    ``SystemExit`` leaves no submitit result behind, as submitit's own exit does.
    """
    import submitit

    preemption = submitit.JobEnvironment._usr_sig()
    if signum not in (None, preemption):
        log.warning("stopped after %s: not requeueing (the scheduler decides)", signal.Signals(signum).name)
        raise SystemExit(ExitStatus.REQUEUE)
    handler = signal.getsignal(preemption)
    if callable(handler):
        handler(preemption, None)  # rank 0: checkpoint(), scontrol requeue, sys.exit
    deadline = time.monotonic() + REQUEUE_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
    log.error("the job was not requeued within %.0f s of the checkpoint; stopping", REQUEUE_WAIT_S)
    raise SystemExit(ExitStatus.REQUEUE)


def _slurm_job_key() -> str:
    """The id ``sacct`` knows this job by: ``ID``, or ``ARRAYID_INDEX`` for an array element."""
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID", "")


def requeue_from_rank_zero() -> None:
    """Requeue this job (which ends it) from the task of rank 0; submitit requeues only from
    its signal handler, and a run that stops by itself at its deadline needs it too."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if job_id and os.environ.get("SLURM_PROCID", "0") == "0":
        subprocess.run(["scontrol", "requeue", job_id], check=False)


def executor_parameters(request: JobRequest) -> dict[str, Any]:
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


class SubmititScheduler(Scheduler):
    name = "submitit"
    family = "slurm"

    def dry_run(self, request: JobRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        self.check_profile(request)
        if request.torchrun_per_node:
            raise UserError("--torchrun renders a batch script: use it with --sbatch")
        if request.max_restarts or request.spare_nodes:
            raise UserError("--max-restarts and --spare-nodes relaunch ranks from a batch script: use them with "
                            "--sbatch")
        if request.preflight:
            raise UserError("--preflight runs a step before the ranks in a batch script: use it with --sbatch")
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
        if isinstance(request.payload, CommandPayload):
            if not request.elements:
                return [SubmititCommandTask(request.payload, workdir, str(dry_run.run_folder))]
            return [SubmititCommandTask(request.payload, workdir, str(dry_run.workdir / request.element_run_folder(e)),
                                        e.environment()) for e in request.elements]
        payloads = [request.element_payload(e) for e in request.elements] or [request.payload]
        return [SubmititTrainTask(payload, workdir, requeue=request.chain == 1) for payload in payloads]

    def submit(self, dry_run: DryRun) -> Submission:
        import submitit

        run_tool(["sbatch", "--version"], "submitit submits through SLURM's sbatch")
        folder = self.folder(dry_run)
        executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
        executor.update_parameters(**dry_run.parameters)
        tasks = self.tasks(dry_run)
        if dry_run.request.sweep is not None:
            jobs = executor.submit_array(tasks)
            return self._submission(dry_run, [jobs[0].job_id.split("_")[0]], self._logs(folder, jobs, 1),
                                    ("submitit", "sbatch", "--array"), [job.job_id for job in jobs])
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
        return [str(folder / f"{job.job_id}_{rank}_log.{kind}") for job in jobs for rank in range(ranks)
                for kind in ("out", "err")]

    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        return slurm_status(job_id, exit_file)

    def cancel_jobs(self, job_ids) -> None:
        run_tool(["scancel", *job_ids], "scancel cancels SLURM jobs")

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

"""Hand a job to the scheduler: qsub, sbatch or submitit; optionally wait for its summary."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_hpc.errors import UserError
from ddp_hpc.launch.request import JobRequest, export_lines, parse_walltime
from ddp_hpc.stop import SLURM_DEADLINE_LINES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    job_id: str
    script: Path | None
    submitted_at: float


class JobFailed(UserError):
    """The job ended without writing its summary."""

    exit_code = 1


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str:
    if shutil.which(argv[0]) is None:
        raise UserError(f"{argv[0]} not found on PATH: {what}")
    result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise UserError(f"{argv[0]} failed (exit {result.returncode}): {detail[0] if detail else 'no output'}")
    return result.stdout.strip()


def write_script(text: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def submit_script(command: str, script: Path) -> Submitted:
    """``qsub SCRIPT`` or ``sbatch --parsable SCRIPT``, from the script's working folder."""
    argv = [command, str(script)] if command == "qsub" else [command, "--parsable", str(script)]
    hint = (f"the rendered script is at {script}; submit it where the scheduler runs: "
            f"{command} {script}")
    job_id = _run(argv, hint).split(";")[0]
    return Submitted(job_id, script, time.time())


# ----- waiting --------------------------------------------------------------------------------

_FINISHED_PBS = {"C", "F", "E", "X"}
_ACTIVE_SLURM = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING",
                 "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED"}


def pbs_state(job_id: str) -> str | None:
    """The job's state letter from qstat, or None once qstat no longer knows it."""
    result = subprocess.run(["qstat", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    for line in result.stdout.splitlines():
        fields = line.split()
        if fields and fields[0].split(".")[0] == job_id.split(".")[0] and len(fields) >= 5:
            return fields[4]
    return None


def slurm_state(job_id: str) -> str | None:
    result = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True,
                            text=True)
    states = [s.split()[0] for s in result.stdout.split() if s.strip()] if result.returncode == 0 else []
    return states[0] if states else None


def wait_until_done(job_id: str, scheduler: str, poll_s: float = 2.0, timeout_s: float | None = None,
                    confirmations: int = 3) -> None:
    """Poll until the job is over. A requeue passes through a terminal-looking state for a
    moment (the step ended, the job is not yet pending again), so the end must be seen on
    ``confirmations`` polls in a row."""
    started = time.monotonic()
    seen_done = 0
    while True:
        if scheduler == "pbs":
            state = pbs_state(job_id)
            done = state is None or state in _FINISHED_PBS
        else:
            state = slurm_state(job_id)
            done = state is not None and state not in _ACTIVE_SLURM
        seen_done = seen_done + 1 if done else 0
        if seen_done >= confirmations:
            return
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise UserError(f"job {job_id} still {state} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def read_summary(run_folder: Path, since: float) -> dict[str, Any] | None:
    path = run_folder / "summary.json"
    if path.exists() and path.stat().st_mtime >= since - 1:
        return json.loads(path.read_text())
    return None


def job_output_tail(folder: Path, job_id: str, lines: int = 20) -> str:
    number = job_id.split(".")[0]
    candidates = sorted(folder.glob(f"*.o{number}")) + sorted(folder.glob(f"logs/*-{number}.out"))
    for path in candidates:
        return f"{path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no job output file found)"


def wait_for_summary(submitted: Submitted, request: JobRequest, scheduler: str, workdir: Path,
                     poll_s: float = 2.0) -> dict[str, Any]:
    wait_until_done(submitted.job_id, scheduler, poll_s)
    summary = read_summary(workdir / request.run_folder, submitted.submitted_at)
    if summary is None:
        raise JobFailed(f"job {submitted.job_id} ended without a training summary; "
                        f"{job_output_tail(workdir, submitted.job_id)}")
    return summary


# ----- submitit -------------------------------------------------------------------------------

class SubmititTrainTask:
    """What each SLURM task runs under submitit: ``ddp-hpc train`` on this rank.

    ``checkpoint`` is submitit's hook on preemption and timeout: the job is requeued with
    the same task, which resumes from the run's newest checkpoint (``resume: auto``).

    submitit's own handler for its signal (SIGUSR2) would requeue at once, killing the
    ranks wherever they are. Instead the ranks take the signal as under sbatch: they agree
    on a step, checkpoint there and stop; only then is submitit's handler called, which
    calls ``checkpoint`` and requeues. A stop for the job's deadline is handed over the
    same way. After SIGTERM (scancel, preemption; submitit ignores it) the ranks stop
    and the scheduler decides what comes next.
    """

    def __init__(self, config_path: str, overrides: tuple[str, ...], workdir: str) -> None:
        self.config_path, self.overrides, self.workdir = config_path, overrides, workdir

    def __call__(self) -> dict[str, Any]:
        from ddp_hpc.logs import configure_logging
        from ddp_hpc.train import Preempted, TrainRequest, train

        os.chdir(self.workdir)
        configure_logging(None)
        try:
            return train(TrainRequest(self.config_path, self.overrides))
        except Preempted as stopped:
            hand_over_to_submitit(stopped.signum)
            raise

    def checkpoint(self, *args: Any, **kwargs: Any):
        import submitit

        return submitit.helpers.DelayedSubmission(SubmititTrainTask(self.config_path, self.overrides, self.workdir))


#: How long the other ranks wait for rank 0's requeue to end them.
REQUEUE_WAIT_S = 120.0


def hand_over_to_submitit(signum: int | None) -> None:
    """After the agreed-step checkpoint: let submitit do what its signal handler is for.

    Every rank calls submitit's handler for its preemption signal (now restored): rank 0's
    calls ``checkpoint()``, requeues the job and exits; the others' only log. They then
    wait to be ended by the requeue rather than exit first (a task that ends with an error
    would report the job as failed, and ``--kill-on-bad-exit`` would stop the requeue).
    ``SystemExit`` leaves no submitit result behind, as submitit's own exit does.
    """
    import signal

    import submitit

    preemption = submitit.JobEnvironment._usr_sig()
    if signum not in (None, preemption):
        log.warning("stopped after %s: not requeueing (the scheduler decides)", signal.Signals(signum).name)
        raise SystemExit(75)
    handler = signal.getsignal(preemption)
    if callable(handler):
        handler(preemption, None)  # rank 0: checkpoint(), scontrol requeue, sys.exit
    deadline = time.monotonic() + REQUEUE_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
    log.error("the job was not requeued within %.0f s of the checkpoint; stopping", REQUEUE_WAIT_S)
    raise SystemExit(75)


def submitit_executor(request: JobRequest, folder: Path):
    import submitit

    if shutil.which("sbatch") is None:
        raise UserError("sbatch not found on PATH: submitit submits through SLURM's sbatch")
    profile = request.profile
    _, minutes = parse_walltime(request.walltime)
    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
    params: dict[str, Any] = {
        "name": request.name, "nodes": request.nodes, "tasks_per_node": request.per_node,
        "timeout_min": minutes, "slurm_signal_delay_s": 90,
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
    executor.update_parameters(**params)
    return executor


def submit_with_submitit(request: JobRequest, workdir: Path, wait: bool) -> tuple[str, dict[str, Any] | None]:
    folder = workdir / request.run_folder / "submitit"
    executor = submitit_executor(request, folder)
    task = SubmititTrainTask(request.config_path, request.overrides, str(workdir))
    job = executor.submit(task)
    print(f"submitted job {job.job_id} (submitit logs in {folder})", flush=True)
    if not wait:
        return job.job_id, None
    try:
        results = job.results()
    except Exception as exc:  # submitit raises with one failing task's traceback
        raise JobFailed(submitit_failure(job.job_id, request.world_size, folder, str(exc))) from None
    return job.job_id, results[0]


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

"""What runs inside a SLURM job submitted with submitit, on every task: the callables
submitit pickles (a training config, or the user's command), and the requeue after a
checkpoint taken on request. The batch-script backend's in-job side is its rendered script
(``render.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, NoReturn

from ddp_hpc.contract import RESTART_COUNT_VAR, RESTARTED_MARKER_PREFIX, SUBMISSION_FILE, ExitStatus
from ddp_hpc.launch.left_out import LeftOutHost, record_left_out
from ddp_hpc.launch.outcome import attempt_outcome, failed_rank_here
from ddp_hpc.specs.request import CommandPayload, TrainPayload
from ddp_hpc.launch.restart import LaunchEnd, RestartPolicy
from ddp_hpc.contract.slurm_job_key import JOB_ID_VAR, job_key
from ddp_hpc.environment.jobs import SlurmJob
from ddp_hpc.stop_handler import record_stop_signals

log = logging.getLogger(__name__)

#: How long a command job's checkpoint() waits for the command to stop, at most.
COMMAND_STOP_WAIT_S = 80


class SubmititTrainTask:
    """What each SLURM task runs for a training config: ``train`` on this rank.

    submitit's own handler for its signal (SIGUSR2) would requeue at once, killing the
    ranks wherever they are. Instead the ranks take the signal as under sbatch (the rank's
    one stop-signal handler, ``ddp_hpc.stop_handler``, from the task's start): they agree
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
        # First, before torch is imported: submitit's handler would requeue at once on a
        # signal that comes during start-up; recorded, it is a stop at the first agreed step.
        handler = record_stop_signals()
        from ddp_hpc.training.run_on_rank import TrainOptions, train

        os.chdir(self.workdir)
        options = TrainOptions(configure_logs=True, handle_signals=True)
        summary = train(self.payload.config_path, self.payload.overrides, options=options)
        if not summary.preempted:
            return summary.to_dict()  # a signal from now on is recorded, not a requeue of a finished run
        if not self.requeue:  # a chain's next link continues the run
            raise SystemExit(summary.exit_status)
        handler.give_back()  # submitit's handler again: the hand-over calls it
        hand_over_to_submitit(signal.Signals[summary.stopped_by] if summary.stopped_by else None)

    def checkpoint(self, *args: Any, **kwargs: Any):
        import submitit

        # Requeued with the same task: it resumes from the run's newest checkpoint (resume: auto).
        if not self.requeue:
            return None
        return submitit.helpers.DelayedSubmission(SubmititTrainTask(self.payload, self.workdir))


@dataclass(frozen=True)
class Resubmission:
    """``--max-restarts`` for a submitit command job: when the restart policy says so after a
    rank's command fails (``launch/restart.py``), the job is submitted again (a resubmission,
    not a restart in place: submitit has no batch script to loop in) with the same executor
    parameters and ``--exclude`` of every node where a rank failed."""

    #: The executor's parameters as submitted (``executor_parameters``).
    parameters: dict[str, Any]
    #: submitit's folder for the job's files.
    folder: str
    max_restarts: int
    attempt: int = 0
    excluded: tuple[str, ...] = ()

    @property
    def policy(self) -> RestartPolicy:
        return RestartPolicy(self.max_restarts)


class SubmititCommandTask:
    """What each SLURM task runs for a command job: the command, as a child with torchrun's
    variables. A child that exits with ``ExitStatus.REQUEUE`` (checkpointed on request) gets the
    job requeued (rank 0, through ``LaunchEnd``, a launch's one end); one that fails, with
    ``restart`` and restarts left, gets the job submitted again without this node."""

    def __init__(self, payload: CommandPayload, workdir: str, run_folder: str,
                 extra_env: dict[str, str] | None = None, restart: Resubmission | None = None) -> None:
        self.payload, self.workdir, self.run_folder = payload, workdir, run_folder
        self.extra_env = dict(extra_env or {})  # a sweep element's variables
        self.restart = restart
        self._child: subprocess.Popen | None = None

    def __call__(self) -> int:
        from ddp_hpc.run.torchrun_env import command_environment

        os.chdir(self.workdir)
        launch = command_environment(self.payload.argv)
        sys.stdout.flush()
        attempt = {RESTART_COUNT_VAR: str(self.restart.attempt)} if self.restart else {}
        self._child = subprocess.Popen(list(launch.argv),
                                       env={**launch.environment(os.environ), **self.extra_env, **attempt})
        code = self._child.wait()
        rank = int(launch.environment(os.environ).get("RANK", "0"))
        job_id = job_key(os.environ)
        policy, attempt = (self.restart.policy, self.restart.attempt) if self.restart else (RestartPolicy(0), 0)
        # A new job can always be asked to run without this node: every failure names one to leave out.
        outcome = attempt_outcome(attempt, ExitStatus.of_returncode(code),
                                  failed=failed_rank_here(rank, code, os.environ), spare=True)
        decision = policy.decide(outcome.status, attempt)
        if rank == 0:  # a launch's one end: the job requeued after the command's stop, else its exit file
            Path(self.run_folder).mkdir(parents=True, exist_ok=True)
            LaunchEnd(Path(self.run_folder), job_id or "", SlurmJob().requeue_command(os.environ.get(JOB_ID_VAR, "")))(decision)
        if decision.restart and outcome.left_out is not None:
            self._restart_without_this_node(outcome.left_out, job_id)
        if code != 0:
            raise RuntimeError(f"command {self.payload.describe()!r} exited with status {code} on rank {rank}")
        return code

    def _restart_without_this_node(self, left_out: LeftOutHost, job_id: str | None) -> None:
        """The first rank to fail submits the job again, leaving out its node (the attempt's
        ``Outcome.left_out``), and points the run folder's submission record at the new job
        (``status``/``--wait`` follow it)."""
        import submitit

        plan = self.restart
        folder = Path(self.run_folder)
        # One restart per failed job, the first failing rank's (named after the job: a later
        # submission into the same run folder restarts again).
        try:
            marker = folder / f"{RESTARTED_MARKER_PREFIX}{job_id or plan.attempt}"
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        following = dataclasses.replace(plan, attempt=plan.attempt + 1, excluded=(*plan.excluded, left_out.host))
        executor = submitit.AutoExecutor(folder=plan.folder, cluster="slurm")
        executor.update_parameters(**plan.parameters, slurm_exclude=",".join(following.excluded))
        try:
            job = executor.submit(SubmititCommandTask(self.payload, self.workdir, self.run_folder, self.extra_env,
                                                      following))
        except Exception as exc:  # e.g. too few nodes left: the command's own failure is what matters
            log.error("could not submit the restart without node(s) %s: %s", ",".join(following.excluded),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        # Recorded once the restart exists: `status` shows a node left out only for a job without it.
        record_left_out(folder, left_out)
        log.warning("leaving out node(s) %s, where a rank failed (%s): restart %d of %d as job %s",
                    ",".join(following.excluded), left_out.reason, following.attempt, plan.max_restarts, job.job_id)
        follow_resubmission(folder, job_id, job.job_id, plan.folder)

    def checkpoint(self, *args: Any, **kwargs: Any):
        """submitit's time-limit/preemption hook: pass the signal on, let the command
        checkpoint and exit, then requeue the same task."""
        import submitit

        if self._child is not None and self._child.returncode is None:
            self._child.send_signal(signal.SIGUSR2)
            wait_for_exit(self._child.pid, COMMAND_STOP_WAIT_S)
        return submitit.helpers.DelayedSubmission(
            SubmititCommandTask(self.payload, self.workdir, self.run_folder, self.extra_env, self.restart))


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Whether child ``pid`` exits within ``timeout_s``, leaving it for its ``Popen`` to reap.

    Not ``Popen.wait``/``poll``: submitit calls ``checkpoint`` from its signal handler, which
    interrupts ``__call__``'s ``wait`` on the same child while that holds the ``Popen``'s
    waitpid lock; a nested ``wait(timeout)`` then never gets the lock and always waited the
    whole timeout (80 s before each requeue)."""
    give_up_at = time.monotonic() + timeout_s
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already
            return True
        if time.monotonic() >= give_up_at:
            return False
        time.sleep(0.05)


def follow_resubmission(run_folder: Path, old_job: str | None, new_job: str, submitit_folder: str) -> None:
    """Point ``RUN/submission.json`` at ``new_job`` (the old one joins ``chain``), with its logs."""
    from ddp_hpc.schedulers.base import Submission

    try:
        submission = Submission.from_json((run_folder / SUBMISSION_FILE).read_text())
    except (OSError, ValueError, TypeError):
        log.warning("no submission record in %s: status will not follow job %s", run_folder, new_job)
        return
    chain = submission.chain or (old_job or submission.job_id,)
    logs = tuple(submitit_logs(Path(submitit_folder), [new_job], submission.world_size))
    dataclasses.replace(submission, job_id=new_job, chain=(*chain, new_job), logs=logs).record()


def submitit_logs(folder: Path, job_ids: list[str], ranks: int) -> list[str]:
    """The files submitit writes each task's stdout and stderr to."""
    return [str(folder / f"{job_id}_{rank}_log.{kind}") for job_id in job_ids for rank in range(ranks)
            for kind in ("out", "err")]


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
    give_up_at = time.monotonic() + REQUEUE_WAIT_S
    while time.monotonic() < give_up_at:
        time.sleep(1.0)
    log.error("the job was not requeued within %.0f s of the checkpoint; stopping", REQUEUE_WAIT_S)
    raise SystemExit(ExitStatus.REQUEUE)


def __getattr__(name: str) -> object:
    if name == "RestartPlan":  # the old name; also what a job submitted before the rename unpickles
        import warnings

        warnings.warn("ddp_hpc.schedulers.slurm.in_job.RestartPlan is deprecated: use Resubmission",
                      DeprecationWarning, stacklevel=2)
        return Resubmission
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""What an attempt ended as (launch/outcome.py): one function from the launcher's status, the
preempted marker and the failed-rank evidence, each evidence reader, and the launch acting on
the outcome (``attempts.MarkedAttempts``). In-process: nothing is launched."""

from __future__ import annotations

import io
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest

from ddp_hpc.contract import PREEMPTED_MARKER, RANK_FAILURES_PREFIX, RUN_FOLDER_VAR, ExitStatus
from ddp_hpc.launch.attempts import MarkedAttempts
from ddp_hpc.launch.hosts import HostfileAttempts, HostLaunch
from ddp_hpc.launch.left_out import LeftOutHost
from ddp_hpc.launch.outcome import (Ended, FailedRank, Outcome, attempt_outcome, failed_rank_here,
                                    failed_rank_in_file, failed_rank_in_srun_line)
from ddp_hpc.launch.srun import _StepLog


@dataclass
class Fake:
    """Attempts that start nothing; with ``named``, a launcher that names the failed rank's host."""

    named: FailedRank | None = None
    has_spare: bool = True
    started: list[int] = field(default_factory=list)
    without: list[LeftOutHost] = field(default_factory=list)

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> Sequence[subprocess.Popen]:
        self.started.append(attempt)
        return []

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        pass

    def read_status(self, attempt: int, status: int) -> int:
        return status

    def describe(self) -> str:
        return ""

    def failed_rank(self, attempt: int) -> FailedRank | None:
        return self.named

    def run_without(self, host: LeftOutHost) -> None:
        self.without.append(host)


@dataclass
class Unnamed:
    """Attempts whose launcher names no failed rank (``LocalRanks``, ``MpiexecHere``)."""

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> Sequence[subprocess.Popen]:
        return []

    def read_status(self, attempt: int, status: int) -> int:
        return status


N2 = FailedRank("n2", "rank 3 exited with status 137", 3)


def test_every_rank_at_0_finished_and_75_stopped():
    assert attempt_outcome(0, 0, failed=N2, spare=True) == Outcome(0, Ended.FINISHED, 0)
    assert attempt_outcome(2, 75, failed=N2, spare=True) == Outcome(2, Ended.STOPPED, ExitStatus.REQUEUE)


@pytest.mark.parametrize("launcher_says", [0, 137, 143, 1])
def test_the_preempted_marker_is_a_stop_whatever_the_launcher_says(tmp_path, launcher_says):
    """MPICH's Hydra may report the ranks' 75 as 0, srun's --kill-on-bad-exit as a kill: the
    marker rank 0 wrote during the attempt says they stopped, and no host is left out."""
    attempts = MarkedAttempts(Fake(named=N2), tmp_path)
    attempts.start(0)
    (tmp_path / PREEMPTED_MARKER).touch()
    outcome = attempts.read_outcome(0, launcher_says)
    assert outcome == Outcome(0, Ended.STOPPED, ExitStatus.REQUEUE)
    assert attempts.read_status(0, launcher_says) == ExitStatus.REQUEUE


def test_a_marker_left_by_an_earlier_attempt_is_cleared_before_the_next_starts(tmp_path):
    (tmp_path / PREEMPTED_MARKER).touch()
    attempts = MarkedAttempts(Fake(), tmp_path)
    attempts.start(0)
    assert attempts.read_outcome(0, 0).ended is Ended.FINISHED


def test_a_failure_names_the_rank_and_leaves_its_host_out_only_where_there_is_a_spare():
    failed = attempt_outcome(1, 137, failed=N2, spare=True)
    assert (failed.ended, failed.status, failed.failed) == (Ended.FAILED, 137, N2)
    assert failed.left_out == LeftOutHost("n2", 1, "rank 3 exited with status 137")
    assert attempt_outcome(1, 137, failed=N2, spare=False).left_out is None
    assert attempt_outcome(1, 1, spare=True) == Outcome(1, Ended.FAILED, 1)  # no evidence: nothing left out


def test_the_next_attempt_runs_without_the_host_the_outcome_left_out(tmp_path):
    named = Fake(named=N2)
    attempts = MarkedAttempts(named, tmp_path)
    attempts.start(0)
    assert attempts.read_outcome(0, 137).left_out == LeftOutHost("n2", 0, N2.reason)
    attempts.start(1)
    assert named.without == [LeftOutHost("n2", 0, N2.reason)] and named.started == [0, 1]
    assert attempts.read_outcome(1, 0).ended is Ended.FINISHED
    attempts.start(2)
    assert len(named.without) == 1
    no_spare = Fake(named=N2, has_spare=False)
    attempts = MarkedAttempts(no_spare, tmp_path)
    attempts.start(0)
    assert attempts.read_outcome(0, 137).failed == N2
    attempts.start(1)
    assert no_spare.without == []
    plain = MarkedAttempts(Unnamed(), tmp_path)  # a launcher that names no rank: a failure, nothing left out
    plain.start(0)
    assert plain.read_outcome(0, 1) == Outcome(0, Ended.FAILED, 1)


def test_the_rank_wrapper_s_file_names_the_first_failed_rank_and_its_host(tmp_path):
    """mpiexec over a hostfile: the first line of ``rank-failures-<attempt>`` is the first
    rank that failed; its host is the attempt's, ``per_host`` ranks each."""
    (tmp_path / f"{RANK_FAILURES_PREFIX}1").write_text("3 137\n1 143\n")
    assert failed_rank_in_file(tmp_path, 1, ("h1", "h2"), 2) == FailedRank("h2", "rank 3 exited with status 137", 3)
    assert failed_rank_in_file(tmp_path, 1, ("h1", "h2", "h3", "h4"), 1) == FailedRank("h4", N2.reason, 3)
    assert failed_rank_in_file(tmp_path, 1, ("h1",), 2) is None  # not a host of the attempt
    assert failed_rank_in_file(tmp_path, 0, ("h1", "h2"), 2) is None  # no file: nothing named
    launch = HostLaunch("mpich", ("h1", "h2", "h3"), 2, 2, ("true",), tmp_path, max_restarts=1)
    hostfile = HostfileAttempts(launch, hosts=("h1", "h3"))  # h2 left out of attempt 1 already
    outcome = MarkedAttempts(hostfile, tmp_path).read_outcome(1, 137)
    assert outcome.failed == FailedRank("h3", "rank 3 exited with status 137", 3)
    assert outcome.left_out == LeftOutHost("h3", 1, "rank 3 exited with status 137")
    hostfile.run_without(outcome.left_out)
    assert hostfile.excluded == ["h3"]


def test_srun_s_error_line_names_the_failed_task_s_node(monkeypatch):
    line = "srun: error: n2: task 3: Killed"
    assert failed_rank_in_srun_line(line) == FailedRank("n2", line, 3)
    assert failed_rank_in_srun_line("srun: error: Timed out waiting for job step") is None
    monkeypatch.setattr("sys.stderr", io.TextIOWrapper(io.BytesIO()))
    step_log = _StepLog(io.BytesIO(b"rank output\nsrun: error: n4: task 0: Exited with exit code 1\n"
                                   b"srun: error: n2: task 3: Killed\n"))
    step_log.start()
    assert step_log.finished() == FailedRank("n4", "srun: error: n4: task 0: Exited with exit code 1", 0)


def test_a_rank_watching_its_own_command_names_its_node():
    """A submitit task: the node SLURM named, else the host's name; the status as the shell says it."""
    assert failed_rank_here(1, -9, {"SLURMD_NODENAME": "n7"}) == FailedRank("n7", "rank 1 exited with status 137", 1)
    assert failed_rank_here(0, 3, {}).host == socket.gethostname()
    outcome = attempt_outcome(0, 137, failed=failed_rank_here(1, -9, {"SLURMD_NODENAME": "n7"}), spare=True)
    assert outcome.left_out == LeftOutHost("n7", 0, "rank 1 exited with status 137")


def test_a_submitit_task_restarts_the_job_without_the_host_its_outcome_left_out(tmp_path, monkeypatch):
    """A submitit command job's task ran its command, which failed with restarts left: the new
    job runs without this node (``Outcome.left_out``); a finished command restarts nothing."""
    from ddp_hpc.schedulers.slurm import in_job
    from ddp_hpc.specs.request import CommandPayload

    restarted: list[tuple] = []
    monkeypatch.setattr(in_job.SubmititCommandTask, "_restart_without_this_node",
                        lambda self, *args: restarted.append(args))
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    plan = in_job.Resubmission(parameters={}, folder=str(tmp_path / "submitit"), max_restarts=2, attempt=1)
    for code in (3, 0):
        task = in_job.SubmititCommandTask(CommandPayload(("sh", "-c", f"exit {code}")), str(tmp_path),
                                          str(tmp_path / "run"), restart=plan)
        if code:
            with pytest.raises(RuntimeError, match="exited with status 3"):
                task()
        else:
            assert task() == 0
    assert restarted == [(LeftOutHost("n7", 1, "rank 0 exited with status 3"), "")]


def test_the_old_name_of_a_submitit_resubmission_still_answers_and_unpickles():
    """``RestartPlan`` (a resubmission, not a restart) is ``Resubmission`` now: the old name
    warns, and a pickle made under it (a job submitted before the rename) loads."""
    import pickle
    import warnings

    from ddp_hpc.schedulers.slurm import in_job

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = in_job.RestartPlan
    assert old is in_job.Resubmission and caught and issubclass(caught[0].category, DeprecationWarning)
    plan = in_job.Resubmission(parameters={}, folder="f", max_restarts=1)
    under_old_name = pickle.dumps(plan, protocol=0).replace(b"\nResubmission\n", b"\nRestartPlan\n")  # no lengths in protocol 0
    assert b"RestartPlan" in under_old_name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert pickle.loads(under_old_name) == plan


@pytest.mark.parametrize("reason", ["srun: error: n2: task 3: Exited with exit code 2", "rank 3 exited with status 2"])
def test_a_first_failed_rank_that_exited_2_is_the_users_mistake_whatever_the_launcher_says(reason):
    """srun (its tasks' highest status) or mpiexec over a hostfile may report the 137 of a
    rank ended after another refused the user's mistake: the first failed rank's evidence
    says 2, the attempt ends with 2 (never restarted), and no host is left out for it."""
    failed = FailedRank("n2", reason, 3)
    assert attempt_outcome(0, 137, failed=failed, spare=True) == Outcome(0, Ended.FAILED, ExitStatus.USAGE, failed)
    assert attempt_outcome(0, 2, failed=N2, spare=True) == Outcome(0, Ended.FAILED, ExitStatus.USAGE, N2)
    assert attempt_outcome(0, 137, failed=N2, spare=True).status == 137


def test_the_rank_wrapper_keeps_a_stopped_rank_s_75_when_the_stop_reaches_its_process_group(tmp_path):
    """Hydra's proxy signals the wrapper's process group: the wrapper's trap passes the
    SIGTERM on while the rank gets it too and exits 75. Waiting in bash's ``wait`` through
    that lost the rank's status in about 1 of 10 stops (bash 5.2 then gives -1: exit 255, a
    "failure" recorded for a rank that stopped as asked); 25 stops must each give 75."""
    import os
    import signal
    import time

    from ddp_hpc.launch.script import recording_rank_failures

    rank = f'trap "exit 75" TERM; touch {tmp_path}/ready; while :; do sleep 0.1; done'
    statuses = []
    for _ in range(25):
        (tmp_path / "ready").unlink(missing_ok=True)
        wrapper = subprocess.Popen(recording_rank_failures(["sh", "-c", rank]), start_new_session=True,
                                   env={**os.environ, RUN_FOLDER_VAR: str(tmp_path), "PMI_RANK": "1"},
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(wrapper.pid, signal.SIGTERM)
        statuses.append(wrapper.wait(timeout=30))
    assert statuses == [ExitStatus.REQUEUE] * 25, statuses
    assert not (tmp_path / f"{RANK_FAILURES_PREFIX}0").exists()

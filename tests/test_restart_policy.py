"""The one restart policy (ddp_hpc/launch/restart.py): its table, and the supervisor of
``ddp-hpc launch`` (where every rendered script ends) applying it to real processes (small
shell commands: no torch)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from ddp_hpc.contract import ExitStatus
from ddp_hpc.launch.restart import Decision, RestartPolicy
from ddp_hpc.launch.local import LocalRanks
from ddp_hpc.launch.supervisor import Supervisor


@pytest.mark.parametrize("status,attempt,stop,expected", [
    (0, 0, False, Decision(restart=False, status=0)),
    (75, 0, False, Decision(restart=False, status=75, requeue=True)),  # a stop: never restarted in place
    (1, 0, False, Decision(restart=True, status=1)),
    (137, 1, False, Decision(restart=True, status=137)),
    (137, 2, False, Decision(restart=False, status=137)),  # no restart left: the failure's status
    (143, 0, True, Decision(restart=False, status=143, requeue=True)),  # a stop signal came: no restart
    (0, 0, True, Decision(restart=False, status=0)),  # finished as the signal came: nothing to requeue
    (2, 0, False, Decision(restart=False, status=2)),  # the user's mistake: a restart meets it again
    (2, 0, True, Decision(restart=False, status=2)),  # nor is it requeued after a stop
])
def test_the_policy_table(status, attempt, stop, expected):
    assert RestartPolicy(max_restarts=2).decide(status, attempt, stop) == expected


def sh(*commands: str) -> LocalRanks:
    """One local rank per shell command; the rank's $RANK picks its command."""
    cases = " ".join(f"{rank}) {command} ;;" for rank, command in enumerate(commands))
    return LocalRanks(len(commands), ["sh", "-c", f'case "$RANK" in {cases} esac', "rank"])


def test_a_stop_of_every_rank_is_handed_back_as_75_without_a_restart(tmp_path):
    log = tmp_path / "starts"
    ranks = sh(f'echo "$DDP_HPC_RESTART_COUNT" >>{log}; exit 75', "exit 75")
    assert Supervisor(ranks.start, RestartPolicy(2)).run() == ExitStatus.REQUEUE
    assert log.read_text() == "0\n"


def test_a_failed_rank_ends_the_others_and_the_attempt_is_restarted(tmp_path):
    """Rank 1 fails at once in the first attempt: rank 0 (which would sleep a minute) is
    ended, and both start again with the next restart count."""
    log = tmp_path / "starts"
    ranks = sh(f'echo "0 $DDP_HPC_RESTART_COUNT $WORLD_SIZE $LOCAL_RANK $TORCHELASTIC_RESTART_COUNT" >>{log}; '
               '[ "$DDP_HPC_RESTART_COUNT" = 1 ] || exec sleep 60',  # exec: the signal that ends it reaches the sleep
               # Once rank 0 has written its line: under load, rank 0 could otherwise be ended first.
               f'[ "$DDP_HPC_RESTART_COUNT" = 1 ] || {{ until grep -q "^0 0 " {log}; do sleep 0.05; done; kill -9 $$; }}')
    started = time.monotonic()
    assert Supervisor(ranks.start, RestartPolicy(2), end_grace_s=5).run() == 0
    assert time.monotonic() - started < 20
    assert log.read_text() == "0 0 2 0 0\n0 1 2 0 1\n"


def test_the_last_failure_is_handed_back_when_no_restart_is_left():
    ranks = sh("exit 0", "exit 3")
    assert Supervisor(ranks.start, RestartPolicy(1)).run() == 3


def test_a_rank_that_exits_2_ends_the_launch_with_2_at_once_and_is_not_restarted(tmp_path, caplog):
    """Rank 1 refuses the user's mistake (exit 2) in the first attempt: rank 0 is ended, and
    with restarts left the launch ends with 2, started once, saying why."""
    starts = tmp_path / "starts"
    ranks = sh(f"echo >>{starts}; exec sleep 60", f"until [ -s {starts} ]; do sleep 0.05; done; exit 2")
    started = time.monotonic()
    assert Supervisor(ranks.start, RestartPolicy(2), end_grace_s=5).run() == ExitStatus.USAGE
    assert time.monotonic() - started < 20
    assert starts.read_text() == "\n"
    assert "not restarted" in caplog.text


def test_a_stop_signal_reaches_every_rank_and_nothing_is_restarted(tmp_path):
    """``request_stop`` (what the CLI's SIGUSR2 handler calls) passes the signal on: rank 0
    stops (75), rank 1 fails on it (1); the launch ends with the failure, not restarted."""
    starts = tmp_path / "starts"
    # Each rank gives up after 30 s (exit 9): a missing signal fails the test, not hangs it.
    wait = f"echo >>{starts}; touch {tmp_path}/ready$RANK; for i in $(seq 300); do sleep 0.1; done; exit 9"
    supervisor = Supervisor(sh(f"trap 'exit 75' USR2; {wait}", f"trap 'exit 1' USR2; {wait}").start,
                            RestartPolicy(2))

    def stop_when_ready() -> None:
        while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
            time.sleep(0.05)
        supervisor.request_stop(signal.SIGUSR2)

    threading.Thread(target=stop_when_ready, daemon=True).start()
    assert supervisor.run() == 1
    assert starts.read_text() == "\n\n"


def test_ranks_see_torchruns_variables():
    env = LocalRanks(2, ["true"], base_env={}).environment(1, attempt=3, port=29555, run_id="x")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                "DDP_HPC_RESTART_COUNT", "OMP_NUM_THREADS")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "TORCHELASTIC_RUN_ID": "x",
        "TORCHELASTIC_RESTART_COUNT": "3", "DDP_HPC_RESTART_COUNT": "3", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("marked, expected", [(True, ExitStatus.REQUEUE), (False, ExitStatus.OK)])
def test_an_attempt_whose_ranks_wrote_the_preempted_marker_is_a_stop_whatever_mpiexec_says(tmp_path, marked,
                                                                                               expected):
    """MPICH's Hydra, once it passed a SIGTERM on, may report its ranks' 75 as 0: the
    preempted marker rank 0 wrote during the attempt says they stopped (75, never restarted),
    and without it a 0 is the end of the run."""
    from ddp_hpc.contract import PREEMPTED_MARKER
    from ddp_hpc.launch.attempts import MarkedAttempts

    rank0 = f"touch {tmp_path / PREEMPTED_MARKER}; exit 0" if marked else "exit 0"
    attempts = MarkedAttempts(sh(rank0, "exit 0"), tmp_path)
    decision = Supervisor(attempts.start, RestartPolicy(1), read_status=attempts.read_status).run_to_decision()
    assert decision.status == expected and decision.requeue == marked and not decision.restart


@pytest.mark.parametrize("stamp", ["-d @1", "-d @4102444800"])  # 1970; 2100: a file server's clock behind or ahead
def test_whether_an_attempt_stopped_depends_on_no_clock(tmp_path, stamp):
    """The marker an attempt's rank 0 wrote is its stop whatever time the file system stamps
    it with; one left by an earlier launch (or attempt) is not, whatever its time: a launch
    whose rank 0 stamps its marker stops (mpiexec says 0), the next one finishes."""
    from ddp_hpc.contract import PREEMPTED_MARKER
    from ddp_hpc.launch.attempts import MarkedAttempts

    marker = tmp_path / PREEMPTED_MARKER
    rank0 = f'touch {marker}; touch {stamp} {marker}; exit 0'
    stopped = MarkedAttempts(sh(rank0, "exit 0"), tmp_path)
    assert Supervisor(stopped.start, RestartPolicy(1), read_status=stopped.read_status).run() == ExitStatus.REQUEUE
    later = MarkedAttempts(sh("exit 0", "exit 0"), tmp_path)
    decision = Supervisor(later.start, RestartPolicy(1), read_status=later.read_status).run_to_decision()
    assert decision == Decision(restart=False, status=ExitStatus.OK)

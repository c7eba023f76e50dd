"""``ddp-hpc launch --launcher srun`` (launch/srun.py): each attempt one srun step
under the one Supervisor, as a rendered sbatch script runs it. srun and scontrol are small
shell stand-ins: nothing here needs the SLURM cluster or torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_hpc.contract import PREEMPTED_MARKER, ExitStatus
from ddp_hpc.launch.restart import Decision, RestartPolicy
from ddp_hpc.launch.attempts import MarkedAttempts
from ddp_hpc.launch.srun import SrunLaunch, SrunSteps, TorchrunAgents, srun_end
from ddp_hpc.launch.supervisor import Supervisor

#: Records the attempt and its arguments, one line per call; then does what ``$PLAN`` says for this call
#: (its number, 1 first): a shell snippet per call, ``;;``-separated.
SRUN = """#!/bin/sh
printf '%s %s\\n' "$DDP_HPC_RESTART_COUNT" "$*" >>"$RECORD"
call=$(wc -l <"$RECORD")
eval "$(printf '%s' "$PLAN" | awk -v n="$call" 'BEGIN { RS = ";;" } NR == n')"
exit 0
"""
RECORDING_SCONTROL = "#!/bin/sh\nprintf '%s\\n' \"$*\" >>\"$RECORD.scontrol\"\n"


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", RECORDING_SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def steps(tmp_path: Path, bin_dir: Path, plan: str, *, nodes: int = 1, allocated: int = 1) -> MarkedAttempts:
    """The launch's srun attempts, their status read through the preempted marker, as ``launch`` runs them."""
    launch = SrunLaunch(nodes, 2, ("ddp-hpc", "train", "c.yaml"), tmp_path / "run", allocated)
    launch.run_folder.mkdir(exist_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(tmp_path / "record"), "PLAN": plan,
           "DDP_HPC_RUN_FOLDER": str(launch.run_folder)}
    return MarkedAttempts(SrunSteps(launch, base_env=env), launch.run_folder)


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "record").read_text().splitlines()


def test_each_attempt_is_one_srun_step_that_ends_on_a_failed_task():
    launch = SrunLaunch(2, 4, ("ddp-hpc", "train", "c.yaml"), Path("/r"), allocated=3)
    assert launch.step_argv([]) == ["srun", "--kill-on-bad-exit=1", "--wait=60", "--nodes=2", "--ntasks=8",
                                    "--ntasks-per-node=4", "ddp-hpc", "train", "c.yaml"]
    assert "--exclude=n1,n3" in launch.step_argv(["n1", "n3"])


def test_with_torchrun_each_attempt_is_one_torchrun_per_node_that_never_restarts():
    launch = SrunLaunch(2, 4, ("ddp-hpc", "train", "c.yaml"), Path("/r"), allocated=2,
                        torchrun=TorchrunAgents("n1:29400", "7"))
    assert launch.step_argv([]) == [
        "srun", "--kill-on-bad-exit=1", "--wait=60", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
        "torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400",
        "--rdzv-id", "7", "--max-restarts", "0", "--no-python", "ddp-hpc", "train", "c.yaml"]


def test_a_staged_command_runs_from_the_node_s_copy_with_what_the_launch_puts_before_it():
    """``--stage-env`` scripts end in ``ddp-hpc launch ... -- bash -c WRAPPER ddp-hpc-staged
    COMMAND``: the launch keeps the wrapper outermost, so ``ddp-hpc run`` (a foreign command)
    and torchrun (``--torchrun``) come from the node's copy on ``PATH``, not from the shared
    environment the launch runs from."""
    from ddp_hpc.launch.local import rank_command
    from ddp_hpc.launch.script import STAGED_PREFIX

    staged = [*STAGED_PREFIX, "python", "train.py"]
    assert rank_command(staged) == [*STAGED_PREFIX, "ddp-hpc", "run", "--", "python", "train.py"]
    assert rank_command([*STAGED_PREFIX, "ddp-hpc", "train", "c.yaml"]) == [*STAGED_PREFIX, "ddp-hpc", "train",
                                                                             "c.yaml"]
    launch = SrunLaunch(2, 4, tuple(rank_command([*STAGED_PREFIX, "ddp-hpc", "train", "c.yaml"])), Path("/r"),
                        allocated=2, torchrun=TorchrunAgents("n1:29400", "7"))
    step = launch.step_argv([])
    assert step[6:11] == [*STAGED_PREFIX, "torchrun"] and step[-4:] == ["--no-python", "ddp-hpc", "train", "c.yaml"]


def test_a_torchrun_stop_is_passed_on_once_the_step_runs(tmp_path, bin_dir):
    """The stop that comes while the supervisor starts the step waits for it (the supervisor
    passes it on then): the agents get SIGTERM once (a second one during their shutdown
    would end them before their ranks)."""
    (bin_dir / "scancel").write_text("#!/bin/sh\nprintf 'scancel %s\\n' \"$*\" >>\"$RECORD\"\n")
    (bin_dir / "scancel").chmod(0o755)
    launch = SrunLaunch(1, 2, ("true",), tmp_path, 1, TorchrunAgents("n1:29400", "7"))
    srun = SrunSteps(launch, base_env={"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(tmp_path / "record"),
                                       "SLURM_JOB_ID": "7"})
    finished = subprocess.Popen(["true"])
    finished.wait()
    srun.forward_stop(signal.SIGTERM, [])
    srun.forward_stop(signal.SIGTERM, [finished])  # the attempt before
    assert not (tmp_path / "record").exists()
    running = subprocess.Popen(["sleep", "5"])
    try:
        srun.forward_stop(signal.SIGTERM, [running])
    finally:
        running.kill()
        running.wait()
    assert calls(tmp_path) == ["scancel --signal=TERM 7"]


#: The step as Slurm runs it when the stop signal reaches the batch shell (the launch): srun
#: signals its parent, then records what reaches it. srun passes SIGUSR2 on to its tasks (here:
#: they stop, 75); SIGTERM would make it kill them. scancel records its call and signals srun's
#: tasks (here: USR1, they stop).
SIGNALLED_SRUN = """#!/bin/sh
echo $$ >"$RECORD.srun"
trap 'echo srun USR2 >>"$RECORD"; kill $!; exit 75' USR2
trap 'echo srun TERM >>"$RECORD"; kill $!; exit 137' TERM
trap 'kill $!; exit 75' USR1
sleep 20 >/dev/null 2>&1 &
kill -USR2 "$PPID"
wait; exit 1
"""
SIGNALLING_SCANCEL = "#!/bin/sh\nprintf 'scancel %s\\n' \"$*\" >>\"$RECORD\"\nkill -USR1 \"$(cat \"$RECORD.srun\")\"\n"


@pytest.mark.parametrize("torchrun,passed_on", [([], "srun USR2"), (["--torchrun", "n1:29400"], "scancel --signal=TERM 7")],
                         ids=["task-per-rank", "torchrun"])
def test_the_stop_signal_reaches_the_ranks_without_srun_killing_them(tmp_path, bin_dir, torchrun, passed_on):
    """srun passes SIGUSR2 on to its tasks, but kills them on SIGTERM: torchrun agents (which
    SIGUSR2 kills) get SIGTERM from Slurm (scancel --signal, the job's steps), not through srun."""
    for name, text in (("srun", SIGNALLED_SRUN), ("scancel", SIGNALLING_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "PATH": f"{bin_dir}:/usr/bin:/bin",
           "RECORD": str(tmp_path / "record"), "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7"}
    result = subprocess.run([sys.executable, "-m", "ddp_hpc", "launch", "--launcher", "srun", "--run-folder",
                             str(tmp_path / "run"), "--max-restarts", "1", "--stop-signal", "USR2", "--requeue",
                             *torchrun, "--", "ddp-hpc", "train", "c.yaml"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 75, result.stderr
    assert calls(tmp_path) == [passed_on]  # once, and nothing restarted
    assert (tmp_path / "record.scontrol").read_text() == "requeue 7\n"


def test_a_failed_node_is_left_out_of_the_restart_when_the_allocation_has_a_spare(tmp_path, bin_dir):
    """srun names the node of the failed task; the restart runs without it, and the run folder
    records it as the scripts' bash loop did (``ddp-hpc status`` reads it)."""
    srun = steps(tmp_path, bin_dir, "echo 'srun: error: n1: task 1: Killed' >&2; exit 137;; exit 0", allocated=2)
    assert Supervisor(srun.start, RestartPolicy(1), read_status=srun.read_status).run() == 0
    first, second = calls(tmp_path)
    assert first.startswith("0 --kill-on-bad-exit=1 ") and "--exclude" not in first
    assert second.startswith("1 --kill-on-bad-exit=1 ")
    assert "--nodes=1 --ntasks=2 --ntasks-per-node=2 --exclude=n1 ddp-hpc" in second
    recorded = [json.loads(line) for line in (tmp_path / "run" / "left-out-hosts.jsonl").read_text().splitlines()]
    assert recorded == [{"host": "n1", "attempt": 0, "reason": "srun: error: n1: task 1: Killed"}]


def test_without_a_spare_node_the_restart_runs_on_the_same_nodes(tmp_path, bin_dir):
    srun = steps(tmp_path, bin_dir, "echo 'srun: error: n1: task 1: Killed' >&2; exit 137;; exit 0")
    assert Supervisor(srun.start, RestartPolicy(1), read_status=srun.read_status).run() == 0
    assert [call.count("--exclude") for call in calls(tmp_path)] == [0, 0]
    assert not (tmp_path / "run" / "left-out-hosts.jsonl").exists()


def test_a_task_that_refused_the_users_mistake_ends_the_launch_with_2_though_srun_says_137(tmp_path, bin_dir):
    """Task 1 exited 2 (a one-line refusal) and --kill-on-bad-exit killed task 0: srun
    reports the highest status, 137, and its first failed task's line says 2: the launch
    ends with 2, no restart."""
    srun = steps(tmp_path, bin_dir, "echo 'srun: error: n1: task 1: Exited with exit code 2' >&2; "
                                    "echo 'srun: error: n1: task 0: Killed' >&2; exit 137;; exit 0")
    decision = Supervisor(srun.start, RestartPolicy(2), read_status=srun.read_status).run_to_decision()
    assert decision == Decision(restart=False, status=ExitStatus.USAGE)
    assert len(calls(tmp_path)) == 1


def test_ranks_that_stopped_under_kill_on_bad_exit_are_a_stop_not_a_failure(tmp_path, bin_dir):
    """Rank 0 wrote the preempted marker and exited 75; srun killed the others and says 143:
    the attempt is a stop (75): no restart, a requeue."""
    srun = steps(tmp_path, bin_dir, f'touch "$DDP_HPC_RUN_FOLDER/{PREEMPTED_MARKER}"; exit 143')
    decision = Supervisor(srun.start, RestartPolicy(2), read_status=srun.read_status).run_to_decision()
    assert decision == Decision(restart=False, status=ExitStatus.REQUEUE, requeue=True)
    assert len(calls(tmp_path)) == 1


def test_a_marker_from_an_earlier_attempt_does_not_turn_a_failure_into_a_stop(tmp_path, bin_dir):
    srun = steps(tmp_path, bin_dir, "exit 143;; exit 0")
    marker = tmp_path / "run" / PREEMPTED_MARKER
    marker.touch()
    os.utime(marker, (time.time() - 60, time.time() - 60))
    assert Supervisor(srun.start, RestartPolicy(1), read_status=srun.read_status).run() == 0
    assert len(calls(tmp_path)) == 2  # restarted, as a failure


def test_a_stop_before_the_step_started_requeues_the_job_without_starting_it(tmp_path, bin_dir, monkeypatch):
    """Slurm's signal can come before the first step (the launch's handler is installed
    first): nothing is started, there is nothing to checkpoint, and the job requeues."""
    srun = steps(tmp_path, bin_dir, "exit 0")
    supervisor = Supervisor(srun.start, RestartPolicy(1), read_status=srun.read_status)
    supervisor.request_stop(signal.SIGUSR2)
    decision = supervisor.run_to_decision()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("RECORD", str(tmp_path / "record"))
    srun_end(srun.run_folder, {"SLURM_JOB_ID": "7"}, requeue=True)(decision)
    assert not (tmp_path / "record").exists()  # srun never ran
    assert (tmp_path / "record.scontrol").read_text() == "requeue 7\n"
    assert decision.status == 75 and not list(srun.run_folder.glob("exit-*"))


@pytest.mark.parametrize("decision,requeue,exit_file", [
    (Decision(restart=False, status=0), True, "0\n"),
    (Decision(restart=False, status=137), True, "137\n"),
    (Decision(restart=False, status=75, requeue=True), False, "75\n"),  # a chain: the next job resumes
    (Decision(restart=False, status=75, requeue=True), True, None),  # requeued: the job runs again
])
def test_the_end_of_the_job_is_its_exit_file_or_its_requeue(tmp_path, bin_dir, monkeypatch, decision, requeue,
                                                             exit_file):
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("RECORD", str(tmp_path / "record"))
    environ = {"SLURM_JOB_ID": "110", "SLURM_ARRAY_JOB_ID": "104", "SLURM_ARRAY_TASK_ID": "3"}
    srun_end(tmp_path, environ, requeue=requeue)(decision)
    assert [p.read_text() for p in tmp_path.glob("exit-*")] == ([exit_file] if exit_file else [])
    if exit_file:
        assert (tmp_path / "exit-104_3").exists()
    assert (tmp_path / "record.scontrol").exists() is (exit_file is None)


@pytest.mark.parametrize("argv,message", [
    ([], "$SLURM_JOB_NUM_NODES is not set"),
    (["--nodes", "3"], "--nodes 3: the allocation has 2 node(s)"),
    (["--recover", "1", "--torchrun", "n1:29400"], "--torchrun and --recover"),
    (["--recover", "1", "--shrink"], "--shrink works on one node only for now"),
])
def test_bad_use_is_one_line_and_exit_2(tmp_path, bin_dir, argv, message):
    # The stand-in srun: a launch that went on would not reach the test cluster.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "PATH": f"{bin_dir}:/usr/bin:/bin",
           "RECORD": str(tmp_path / "record"), "PLAN": ""}
    if argv:
        env["SLURM_JOB_NUM_NODES"] = "2"
    result = subprocess.run([sys.executable, "-m", "ddp_hpc", "launch", "--launcher", "srun", "--run-folder",
                             str(tmp_path), *argv, "--", "true"], env=env, capture_output=True, text=True, timeout=60)
    [line] = result.stderr.strip().splitlines()
    assert result.returncode == 2 and line.startswith("ddp-hpc: error: ") and message in line, result.stderr

"""Restart in place (--max-restarts): a rank SIGKILLed mid-training, the job relaunches every
rank once, resumes from its checkpoint and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from cpu_groups import favoured
from conftest import FAST_WAIT, FIGURES, REPO, assert_same_training_state, built_once, ddp_hpc_command, run
from ddp_hpc.engine.checkpoint.files import load_checkpoint

pytestmark = [pytest.mark.reliability, pytest.mark.multiproc, pytest.mark.slow]
CONFIG = str(REPO / "configs" / "synthetic.yaml")
COMMON = ["training.epochs=4", "job.params.dropout=0.1", "training.deterministic=true", "logging.progress=never",
          "logging.plot=false", "checkpoint.every_n_steps=5", "validation.early_stopping.patience=null"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    def build(runs: Path) -> None:
        # In a cpu group with the largest shares: on an xdist worker the other worker's ranks
        # share the 2 cores, and the OS could give one of these two ranks half the CPU of the
        # other for a whole window, which is a straggler.
        with favoured("reference") as (_, inside):
            result = run([*inside, *ddp_hpc_command(), "launch", "--nproc", "2", "--", *ddp_hpc_command(), "train",
                          CONFIG, *COMMON, f"logging.run_dir={runs}", "logging.name=reference"], timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        # An unperturbed run: rank 0's heartbeat (every 10 s) named no straggler.
        assert not (runs / "reference" / "record" / "stragglers.json").exists() and "straggler" not in result.stderr

    runs = built_once(tmp_path_factory, "restarts-reference", build)
    return load_checkpoint(runs / "reference" / "checkpoints" / "last.pt")


#: What the relaunched rank 0 logs once it restored the checkpoint of step 10 (a relaunch
#: that silently started over would also end bit-identical: training is deterministic).
RESUMED_AT_10 = re.compile(r"resuming from \S+/step-00000010\.pt: epoch \d+, batch \d+, step 10\n")


def kill_once(tmp_path) -> str:
    marker = tmp_path / "killed"
    return (f"callbacks=[{{target: 'fault_injection:KillRankOnceAtStep', "
            f"params: {{rank: 1, step: 12, marker: '{marker}'}}}}]")


# The Trainer under mpich; every launcher's restart of a loop of one's own is
# tests/test_launch_contract.py's (the same supervisor and policy).
@pytest.mark.parametrize("launcher", ["mpich"])
def test_launch_restarts_once_after_a_killed_rank(launcher, reference, tmp_path, request):
    if launcher == "mpich":
        request.getfixturevalue("mpich")
    result = run([*ddp_hpc_command(), "launch", "--nproc", "2", "--launcher", launcher, "--max-restarts", "1", "--",
                  *ddp_hpc_command(), "train", CONFIG, *COMMON, f"logging.run_dir={tmp_path}", "logging.name=r",
                  kill_once(tmp_path)], timeout=400, env={"PYTHONPATH": str(REPO / "tests")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "killed").exists()
    assert len(RESUMED_AT_10.findall(result.stderr)) == 1, result.stderr[-3000:]
    assert_same_training_state(reference, load_checkpoint(tmp_path / "r" / "checkpoints" / "last.pt"))
    FIGURES.append(f"--max-restarts 1 ({launcher}): rank 1 SIGKILLed at step 12, relaunched, resumed from step 10, "
                   "final weights bit-identical")


@pytest.mark.slurm
def test_sbatch_script_restarts_in_the_same_allocation(reference, slurm_cluster, tmp_path):
    result = run([*ddp_hpc_command(), "submit", "slurm", "--sbatch", "--max-restarts", "1", "--nodes", "1",
                  "--walltime", "10", *FAST_WAIT, CONFIG, *COMMON, f"logging.run_dir={tmp_path / 'runs'}",
                  "logging.name=r", kill_once(tmp_path)], cwd=tmp_path, timeout=500,
                 env={"PYTHONPATH": str(REPO / "tests")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.out"))
    assert "restart 1 of 1" in log and (tmp_path / "killed").exists(), log[-3000:]
    assert len(RESUMED_AT_10.findall(log)) == 1, log[-3000:]
    assert_same_training_state(reference, load_checkpoint(tmp_path / "runs" / "r" / "checkpoints" / "last.pt"))
    FIGURES.append("--max-restarts 1 (sbatch, srun): rank 1 SIGKILLed at step 12, the script relaunched the step in "
                   "the same allocation, final weights bit-identical")


@pytest.mark.slurm
def test_a_restart_with_a_spare_node_leaves_out_the_node_where_a_rank_failed(slurm_cluster, tmp_path):
    probe = ('echo "attempt $DDP_HPC_RESTART_COUNT rank $RANK on $SLURMD_NODENAME"; '
             'if [ "$DDP_HPC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then kill -9 $$; fi; sleep 2')
    result = run([*ddp_hpc_command(), "submit", "slurm", "--sbatch", "--nodes", "1", "--tasks-per-node", "2",
                  "--spare-nodes", "1", "--max-restarts", "1", "--walltime", "5", *FAST_WAIT, "--job-name", "spare",
                  "--", "sh", "-c", probe], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = "".join(p.read_text() for p in (tmp_path / "logs").glob("spare-*.out"))
    places = dict(re.findall(r"attempt (\d) rank \d on (n\d)", log))
    failed = re.search(r"leaving out node\(s\) (n\d), where a rank failed", log)
    assert failed and places.get("0") == failed.group(1), log[-3000:]
    assert places.get("1") not in (None, failed.group(1)), log[-3000:]  # the restart ran on the spare node
    recorded = [json.loads(line) for line in next(tmp_path.glob("runs/*/left-out-hosts.jsonl")).read_text().splitlines()]
    assert [(r["host"], r["attempt"], r["reason"]) for r in recorded] == \
        [(failed.group(1), 0, f"srun: error: {failed.group(1)}: task 1: Killed")]
    FIGURES.append(f"--spare-nodes 1 (sbatch): a rank killed on {failed.group(1)}, the restart ran on {places['1']}")


@pytest.mark.slurm
def test_a_qsub_restart_with_a_spare_node_runs_without_the_host_where_a_rank_died(reference, qsub, tmp_path):
    """PBS (Slurm's qsub over n1, n2): 1 node + 1 spare; rank 1 SIGKILLed at step 12 on the
    first host; the restart's mpiexec runs on the other host, rank 0's address with it, and
    ends bit-identical; ``ddp-hpc status`` shows the host left out and why."""
    result = run([*ddp_hpc_command(), "submit", "pbs", "--cluster", "pbs-generic", "--nodes", "1", "--spare-nodes", "1",
                  "--max-restarts", "1", "--walltime", "10", *FAST_WAIT, CONFIG, *COMMON,
                  f"logging.run_dir={tmp_path / 'runs'}", "logging.name=r", kill_once(tmp_path)], cwd=tmp_path,
                 timeout=500, env={"PYTHONPATH": str(REPO / "tests")})
    log = "".join(p.read_text() for p in tmp_path.glob("*.[oe][0-9]*"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + log[-3000:]
    left = re.search(r"leaving out node\(s\) (n\d), where a rank failed \(rank 1 exited with status 137\)", log)
    assert left, log[-3000:]
    assert len(RESUMED_AT_10.findall(log)) == 1, log[-3000:]
    first, other = left.group(1), {"n1": "n2", "n2": "n1"}[left.group(1)]
    assert f": next attempt on {other}, rank 0 at {other}" in log, log[-3000:]  # the launch's log line
    # The two attempts' run records (a stragglers.json beside them, when the loaded machine
    # slowed one rank, is not one).
    records = sorted((tmp_path / "runs" / "r" / "record").glob("*-step*.json"))
    assert len(records) == 2 and f'"MASTER_ADDR": "{other}"' in records[-1].read_text()
    assert_same_training_state(reference, load_checkpoint(tmp_path / "runs" / "r" / "checkpoints" / "last.pt"))
    status = run([*ddp_hpc_command(), "status", "runs/r"], cwd=tmp_path, timeout=60)
    assert f"left out: {first} (attempt 0: rank 1 exited with status 137)" in status.stdout, status.stdout
    assert [json.loads(line)["host"] for line in
            (tmp_path / "runs" / "r" / "left-out-hosts.jsonl").read_text().splitlines()] == [first]
    FIGURES.append(f"--spare-nodes 1 (qsub): rank 1 killed on {first}, the restart ran on {other}, bit-identical")


@pytest.mark.slurm
def test_a_submitit_job_restarts_as_a_new_job_without_the_node_where_a_rank_failed(reference, slurm_cluster, tmp_path):
    """submitit (no batch script): rank 1 SIGKILLed at step 12 in the first job; its task (which
    runs ``ddp-hpc train`` as a child, and so outlives it) submits the job again with
    ``--exclude`` of that node; ``--wait`` follows the new job, which resumes from the
    checkpoint on the other node and ends bit-identical; ``ddp-hpc status`` shows the node
    left out."""
    result = run([*ddp_hpc_command(), "submit", "slurm", "--nodes", "1", "--tasks-per-node", "2", "--max-restarts", "1",
                  "--walltime", "10", *FAST_WAIT, CONFIG, *COMMON, f"logging.run_dir={tmp_path / 'runs'}",
                  "logging.name=resub", kill_once(tmp_path)], cwd=tmp_path, timeout=500,
                 env={"PYTHONPATH": str(REPO / "tests")})
    folder = tmp_path / "runs" / "resub"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [(failed, reason)] = [(r["host"], r["reason"]) for r in map(json.loads, (folder / "left-out-hosts.jsonl")
                                                                .read_text().splitlines())]
    assert reason == "rank 1 exited with status 137" and (tmp_path / "killed").exists()
    logs = "".join(p.read_text() for p in (folder / "submitit").glob("*_0_log.err"))
    assert len(RESUMED_AT_10.findall(logs)) == 1, logs[-3000:]  # the second job's rank 0
    submission = json.loads((folder / "submission.json").read_text())
    first, again = submission["chain"]
    assert submission["job_id"] == again
    ran_on = {job: run(["sacct", "-X", "-n", "-P", "-o", "NodeList", "-j", job], timeout=60).stdout.strip()
              for job in (first, again)}
    assert ran_on == {first: failed, again: {"n1": "n2", "n2": "n1"}[failed]}, ran_on
    assert_same_training_state(reference, load_checkpoint(folder / "checkpoints" / "last.pt"))
    status = run([*ddp_hpc_command(), "status", str(folder)], cwd=tmp_path, timeout=60)
    assert ": completed, exit status 0" in status.stdout, status.stdout
    assert f"left out: {failed} (attempt 0: rank 1 exited with status 137)" in status.stdout, status.stdout
    FIGURES.append(f"--max-restarts 1 (submitit): rank 1 SIGKILLed at step 12 on {failed}, the job was submitted "
                   f"again without it, ran on {ran_on[again]} and ended bit-identical")


def test_submitits_checkpoint_hook_returns_as_soon_as_the_command_has_stopped(tmp_path, monkeypatch):
    """submitit calls ``checkpoint`` from its signal handler, in the main thread, while the
    task waits on its command: the hook passes the signal on and returns once the command
    has exited (here 0.3 s after it), not after its whole wait (set to 20 s here; it was 80 s
    in every requeue of a submitit command job). The command's status stays for the task."""
    import signal
    import sys
    import threading
    import time

    from ddp_hpc.specs.request import CommandPayload
    from ddp_hpc.schedulers.slurm import in_job

    monkeypatch.setattr(in_job, "COMMAND_STOP_WAIT_S", 20)
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    ready = tmp_path / "ready"
    command = ("import pathlib, signal, sys, time\n"
               "signal.signal(signal.SIGUSR2, lambda *_: (time.sleep(0.3), sys.exit(75)))\n"
               f"pathlib.Path({str(ready)!r}).touch()\n"
               "time.sleep(60)\n")
    task = in_job.SubmititCommandTask(CommandPayload((sys.executable, "-c", command)), str(tmp_path),
                                      str(tmp_path / "run"))
    took: list[float] = []

    def hook(signum, frame):  # what submitit's handler does with the task
        started = time.monotonic()
        task.checkpoint()
        took.append(time.monotonic() - started)

    def signal_once_ready():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, hook)
    try:
        threading.Thread(target=signal_once_ready, daemon=True).start()
        with pytest.raises(RuntimeError, match="exited with status 75"):
            task()
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert len(took) == 1 and took[0] < 10, took


def test_a_submitit_command_that_stops_itself_with_75_is_requeued_not_restarted(tmp_path, monkeypatch):
    """Exit 75 is the command's own checkpointed stop (StopAgreement at the job's deadline):
    the task requeues the job (rank 0, through a launch's one end, ``LaunchEnd``) and neither
    submits it again nor leaves its node out, even with restarts left."""
    from ddp_hpc.launch import restart
    from ddp_hpc.specs.request import CommandPayload
    from ddp_hpc.schedulers.slurm import in_job

    requeued, restarted = [], []
    monkeypatch.setattr(restart, "requeue_job", lambda argv, job_id: requeued.append(tuple(argv)))
    monkeypatch.setattr(in_job.SubmititCommandTask, "_restart_without_this_node",
                        lambda self, *args: restarted.append(args))
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    plan = in_job.Resubmission(parameters={}, folder=str(tmp_path / "submitit"), max_restarts=2)
    for code, expect_requeue, expect_restart in ((75, True, False), (3, False, True)):
        requeued.clear(), restarted.clear()
        task = in_job.SubmititCommandTask(CommandPayload(("sh", "-c", f"exit {code}")), str(tmp_path),
                                          str(tmp_path / "run"), restart=plan)
        with pytest.raises(RuntimeError, match=f"exited with status {code}"):
            task()
        assert (requeued, bool(restarted)) == ([("scontrol", "requeue", "7")] if expect_requeue else [],
                                               expect_restart), code
    assert not (tmp_path / "run" / "left-out-hosts.jsonl").exists()
    assert (tmp_path / "run" / "exit-7").read_text() == "3\n"  # the failure's, not the stop's

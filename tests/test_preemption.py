"""Preemption on the SLURM test cluster: the job is signalled as at its time limit, the
ranks checkpoint, the job is requeued, resumes and ends bit-identical to an uninterrupted run.
All three jobs (signalled, preempted, stopped before the walltime) train under
``training.strategy: fsdp2`` (sharded model and optimizer state); the DDP paths of the same
stops are in test_own_loop.py and test_stop_resume.py."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import FIGURES, REPO, SLURM_DOWN, assert_same_training_state, clean_env, ddp_hpc_command, need, run
from ddp_hpc.engine.checkpoint.files import load_checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.reliability, pytest.mark.slow, pytest.mark.multiproc]
CONFIG = str(REPO / "configs" / "synthetic.yaml")
OVERRIDES = ["training.epochs=12", "job.params.dropout=0.1", "training.deterministic=true", "logging.progress=never",
             "logging.plot=false",
             "checkpoint.preemption_check_every_n_steps=5", "validation.early_stopping.patience=null"]
FSDP2 = ["training.strategy=fsdp2", "checkpoint.format=file", "job.params.hidden=128"]  # a smaller model: quick on a loaded machine


def wait_for(condition, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def job_state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout.strip()


def release_requeued(job_id: str) -> float:
    """Start a requeued job now instead of after Slurm's requeue delay (BeginTime).

    Wait until the nodes are idle, and until the job's old credential (revoked by the
    requeue) is over a second old: slurmd compares credential times at 1-second resolution,
    and a credential created in the same second as the revocation is refused ("Job
    credential revoked").
    """
    requeued = time.time()
    wait_for(nodes_idle, 180, "the nodes to finish cleaning up")
    time.sleep(max(0.0, requeued + 2.0 - time.time()))
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    return time.time()


def nodes_idle() -> bool:
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout.split()
    return bool(states) and all(state == "idle" for state in states)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, slurm_cluster_up) -> dict:
    """The same training (fsdp2), uninterrupted, with the same world size (srun -n 2): one run
    for both signal tests (its final checkpoint)."""
    need(slurm_cluster_up, SLURM_DOWN)
    folder = tmp_path_factory.mktemp("reference")
    result = run(["srun", "-N1", "-n2", *ddp_hpc_command(), "train", CONFIG, *OVERRIDES, *FSDP2,
                  f"logging.run_dir={folder / 'runs'}", "logging.name=reference"], timeout=300, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_checkpoint(folder / "runs" / "reference" / "checkpoints" / "last.pt")


def test_sbatch_job_signalled_before_its_time_limit_resumes_exactly(tmp_path, reference):
    runs = tmp_path / "runs"

    submit = subprocess.Popen(
        [*ddp_hpc_command(), "submit", "slurm", CONFIG, "--sbatch", "--nodes", "1", "--tasks-per-node", "2",
         "--walltime", "20", "--wait", *OVERRIDES, *FSDP2, f"logging.run_dir={runs}", "logging.name=preempted"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_line = submit.stdout.readline()
    job_id = re.search(r"submitted job (\d+)", first_line).group(1)
    checkpoints = runs / "preempted" / "checkpoints"
    wait_for(lambda: list(checkpoints.glob("step-*.pt")), 120, "the first checkpoint")

    # What SLURM does --signal=B:USR2@90 before the time limit: signal the batch shell.
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR2", "--batch", job_id], check=True)
    wait_for(lambda: "PENDING" in job_state(job_id), 120, "the requeue")
    newest = max(checkpoints.glob("step-*.pt"), key=lambda p: p.stat().st_mtime)
    checkpointed = newest.stat().st_mtime
    # Slurm holds a requeued job for a while (BeginTime); a real cluster then starts it when
    # resources allow. Here it is released as soon as that is safe.
    released = release_requeued(job_id)
    out, err = submit.communicate(timeout=300)
    assert submit.returncode == 0, out[-2000:] + err[-3000:]
    assert "job finished: 12 epochs" in out

    log = next((tmp_path / "logs").glob(f"*-{job_id}.out")).read_text()
    assert "received SIGUSR2: will checkpoint and stop" in log
    assert "stopped on request at epoch" in log and "requeueing job" in log
    resumed = re.search(r"(\d\d):(\d\d):(\d\d) \[rank 0\] INFO ddp_hpc.training.trainer: resuming from (\S+?):", log)
    assert resumed and Path(resumed.group(4)).name == newest.name
    resumed_at = time.mktime(time.strptime(time.strftime("%Y-%m-%d ") + ":".join(resumed.group(1, 2, 3)),
                                           "%Y-%m-%d %H:%M:%S"))

    assert_same_training_state(reference, load_checkpoint(checkpoints / "last.pt"))
    FIGURES.append(f"preemption under fsdp2 (sbatch, SIGUSR2 to the batch shell): checkpoint {checkpointed - signalled:.1f}s after "
                   f"the signal; resumed {max(0.0, resumed_at - released):.0f}s (1 s resolution) after the requeued "
                   f"job was released; final weights bit-identical")


def test_submitit_job_preempted_requeues_through_its_checkpoint_hook(tmp_path, reference):
    runs = tmp_path / "runs"
    submit = subprocess.Popen(
        [*ddp_hpc_command(), "submit", "slurm", CONFIG, "--nodes", "1", "--tasks-per-node", "2", "--walltime", "20",
         "--wait", *OVERRIDES, *FSDP2, f"logging.run_dir={runs}", "logging.name=preempted"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = re.search(r"submitted job (\d+)", submit.stdout.readline()).group(1)
    checkpoints = runs / "preempted" / "checkpoints"
    wait_for(lambda: list(checkpoints.glob("step-*.pt")), 120, "the first checkpoint")
    signalled = time.time()
    # submitit asks SLURM for --signal=USR2@90: the tasks get it; task 0 calls checkpoint().
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    wait_for(lambda: "PENDING" in job_state(job_id), 120, "the requeue")
    requeued = time.time()
    release_requeued(job_id)
    out, err = submit.communicate(timeout=300)
    assert submit.returncode == 0, out[-2000:] + err[-3000:]
    assert "job finished: 12 epochs" in out
    logs = "".join(p.read_text() for p in (runs / "preempted" / "submitit").glob("*_0_log.err"))
    # The ranks took the signal before submitit's handler: they agreed on a step (a multiple
    # of preemption_check_every_n_steps=5) and checkpointed there, then submitit requeued.
    assert "received SIGUSR2: will checkpoint and stop" in logs
    stopped = re.search(r"stopped on request at epoch \d+, step (\d+)", logs)
    assert stopped and int(stopped.group(1)) % 5 == 0, logs[-3000:]
    assert re.search(rf"resuming from \S+step-{int(stopped.group(1)):08d}\.pt:", logs), logs[-3000:]
    # submitit's own handler ran only after the checkpoint.
    assert logs.index("stopped on request") < logs.index("Caught signal SIGUSR2") < logs.index("resuming from")
    assert_same_training_state(reference, load_checkpoint(checkpoints / "last.pt"))
    FIGURES.append(f"preemption under fsdp2 (submitit, SIGUSR2 to the tasks): checkpoint at the agreed step {stopped.group(1)}, "
                   f"requeued {requeued - signalled:.1f}s after the signal; final weights bit-identical")


def job_end(job_id: str) -> float:
    """The job's end (its start plus its time limit) as epoch seconds, as the batch script reads it."""
    end = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True).stdout.strip()
    return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S"))


@pytest.mark.timeout(600)
def test_the_rendered_sbatch_script_stops_before_its_walltime_and_requeues(tmp_path, slurm_cluster):
    """``ddp-hpc submit slurm --sbatch --time 1``: the script ddp-hpc renders, on the test
    cluster, a 1-minute fsdp2 job (signal USR2@5) whose ranks ignore every stop signal in
    their first run: only the job's end, which the script exports (DDP_HPC_DEADLINE), can
    stop them ahead of the time limit (deadline_margin_s) with a checkpoint; the script
    requeues, and the requeued job (given 5 minutes) finishes bit-identical to an
    uninterrupted run. (Stops by signal: the preemption tests above, test_own_loop.py.)"""
    # A small model, so that the uninterrupted reference is quick on a loaded machine.
    common = ["job.params.samples=512", "job.params.val_samples=101", "job.params.input_dim=16",
              "job.params.hidden=32", "job.params.depth=2", "training.batch_size=16", "training.epochs=20",
              *OVERRIDES[1:], "checkpoint.deadline_margin_s=35", "training.strategy=fsdp2", "checkpoint.format=file"]
    # Margin 35 s of the 1-minute job: the ranks stop about 25 s after it starts (at their
    # first agreement step if start-up took longer), not 45 s: 20 s less of the SLURM group.
    runs = tmp_path / "runs"
    reference = run(["srun", "-N1", "-n2", *ddp_hpc_command(), "train", CONFIG, *common,
                     f"logging.run_dir={runs}", "logging.name=reference"], timeout=300, cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]

    # Only the first run is slowed (20 epochs x 16 steps x 0.5 s: longer than a minute), and
    # deaf to stop signals: Slurm's may come any time in a 1-minute job.
    slow = ("callbacks=[{target: 'stop_helpers:SlowFirstAttempt', params: {seconds: 0.5}}, "
            "{target: 'stop_helpers:DeafToStopSignals'}]")
    submit = subprocess.Popen(
        [*ddp_hpc_command(), "submit", "slurm", CONFIG, "--sbatch", "--nodes", "1", "--tasks-per-node", "2",
         "--time", "1", "--signal", "USR2@5", "--wait", *common, slow, f"logging.run_dir={runs}",
         "logging.name=deadline"],
        cwd=tmp_path, env=clean_env({"PYTHONPATH": str(REPO / "tests")}), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    job_id = re.search(r"submitted job (\d+)", submit.stdout.readline()).group(1)
    try:
        _stop_requeue_and_resume(tmp_path, runs, job_id, submit)
    finally:  # a failed test leaves no job behind (a requeued one would wait for ever)
        subprocess.run(["scancel", job_id], capture_output=True)
        if submit.poll() is None:
            submit.kill()
            submit.communicate()


def _stop_requeue_and_resume(tmp_path: Path, runs: Path, job_id: str, submit: subprocess.Popen) -> None:
    script = next((runs / "deadline").glob("*.sbatch"), None) or next(tmp_path.rglob("*.sbatch"))
    assert "#SBATCH --time=00:01:00" in script.read_text() and "#SBATCH --signal=B:USR2@5" in script.read_text()
    deadline = wait_for(lambda: "RUNNING" in job_state(job_id) and job_end(job_id), 120, "the job to start")

    def log() -> str:
        path = next((tmp_path / "logs").glob(f"*-{job_id}.out"), None)
        return path.read_text() if path else ""

    wait_for(lambda: "PENDING" in job_state(job_id) and "requeueing job" in log(), 240,
             "the job to stop itself and requeue")
    first = log()
    # The ranks ignore Slurm's signal (it may come up to a minute before the 5 s asked, its
    # event resolution: in a 1-minute job any time): the deadline the script exported stopped them.
    stopped = re.search(r"job deadline in -?[\d.]+ s\b.*: checkpointing and stopping at step (\d+)", first)
    assert stopped and "received SIGUSR2:" not in first, first[-3000:]
    assert "stopped ahead of the job deadline at epoch" in first, first[-3000:]
    by = "deadline"
    step = int(stopped.group(1))
    checkpointed = (runs / "deadline" / "checkpoints" / f"step-{step:08d}.pt").stat().st_mtime
    assert checkpointed < deadline, "the checkpoint came after the time limit"
    # The 1-minute limit is there to make the first attempt stop. The requeued job gets 5
    # minutes, as a real requeued job gets its whole walltime: with 1 minute, margin 35 s, an
    # attempt whose start-up took over 25 s on a loaded machine stopped at its first agreement
    # step, 5 steps on, again and again (CI, 2026-11-23). Slurm's --signal comes any time in
    # the last minute, so the new limit must be more than a minute beyond the start-up too.
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=5"], check=True)
    release_requeued(job_id)
    # Should an attempt still stop and be requeued, release it too instead of waiting out
    # Slurm's requeue delay (minutes).
    until = time.monotonic() + 300
    while submit.poll() is None and time.monotonic() < until:
        if "PENDING BeginTime" in job_state(job_id):
            release_requeued(job_id)
        time.sleep(1.0)
    out, err = submit.communicate(timeout=max(1.0, until - time.monotonic()))
    assert submit.returncode == 0, out[-2000:] + err[-3000:]
    assert re.search(rf"resuming from \S+step-{step:08d}\.pt:", log()), log()[-3000:]
    assert_same_training_state(load_checkpoint(runs / "reference" / "checkpoints" / "last.pt"),
                               load_checkpoint(runs / "deadline" / "checkpoints" / "last.pt"))
    FIGURES.append(f"deadline stop (rendered sbatch, --time 1, signal USR2@5, margin 35 s): stopped by the {by}, "
                   f"checkpoint at step {step} "
                   f"{deadline - checkpointed:.1f} s before the time limit; requeued, final weights bit-identical")

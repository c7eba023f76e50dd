"""Preemption on the SLURM test cluster: the job is signalled as at its time limit, the
ranks checkpoint, the job is requeued, resumes and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import FIGURES, REPO, assert_same_training_state, clean_env, ddp_hpc_command, run
from ddp_hpc.engine.checkpoint_files import load_checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.reliability, pytest.mark.slow, pytest.mark.multiproc]
CONFIG = str(REPO / "configs" / "synthetic.yaml")
OVERRIDES = ["training.epochs=12", "job.params.dropout=0.1", "training.deterministic=true", "logging.progress=never",
             "checkpoint.preemption_check_every_n_steps=5", "validation.early_stopping.patience=null"]


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
    wait_for(nodes_idle, 60, "the nodes to finish cleaning up")
    time.sleep(max(0.0, requeued + 2.0 - time.time()))
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    return time.time()


def nodes_idle() -> bool:
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout.split()
    return bool(states) and all(state == "idle" for state in states)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, slurm_cluster) -> dict:
    """The same training, uninterrupted, with the same world size (srun -n 2): one run for
    both signal tests (its final checkpoint)."""
    folder = tmp_path_factory.mktemp("reference")
    result = run(["srun", "-N1", "-n2", *ddp_hpc_command(), "train", CONFIG, *OVERRIDES,
                  f"logging.run_dir={folder / 'runs'}", "logging.name=reference"], timeout=300, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_checkpoint(folder / "runs" / "reference" / "checkpoints" / "last.pt")


def test_sbatch_job_signalled_before_its_time_limit_resumes_exactly(tmp_path, reference):
    runs = tmp_path / "runs"

    submit = subprocess.Popen(
        [*ddp_hpc_command(), "submit", "slurm", CONFIG, "--sbatch", "--nodes", "1", "--tasks-per-node", "2",
         "--walltime", "20", "--wait", *OVERRIDES, f"logging.run_dir={runs}", "logging.name=preempted"],
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
    FIGURES.append(f"preemption (sbatch, SIGUSR2 to the batch shell): checkpoint {checkpointed - signalled:.1f}s after "
                   f"the signal; resumed {max(0.0, resumed_at - released):.0f}s (1 s resolution) after the requeued "
                   f"job was released; final weights bit-identical")


def test_submitit_job_preempted_requeues_through_its_checkpoint_hook(tmp_path, reference):
    runs = tmp_path / "runs"
    submit = subprocess.Popen(
        [*ddp_hpc_command(), "submit", "slurm", CONFIG, "--nodes", "1", "--tasks-per-node", "2", "--walltime", "20",
         "--wait", *OVERRIDES, f"logging.run_dir={runs}", "logging.name=preempted"],
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
    FIGURES.append(f"preemption (submitit, SIGUSR2 to the tasks): checkpoint at the agreed step {stopped.group(1)}, "
                   f"requeued {requeued - signalled:.1f}s after the signal; final weights bit-identical")


@pytest.mark.timeout(600)
def test_sbatch_job_stops_before_its_walltime_with_no_signal_and_resumes_exactly(tmp_path, slurm_cluster):
    """A 1-minute job and no signal at all: the batch script exports the job's end
    (ddp_hpc.stop.SLURM_DEADLINE_LINES), the ranks stop ahead of it with a checkpoint and
    exit 75, the script requeues, and the requeued job finishes bit-identical."""
    import shlex

    from ddp_hpc.stop import SLURM_DEADLINE_LINES

    # A small model, so that the uninterrupted reference is quick on a loaded machine.
    common = ["job.params.samples=512", "job.params.val_samples=101", "job.params.input_dim=16",
              "job.params.hidden=32", "job.params.depth=2", "training.batch_size=16", "training.epochs=20",
              *OVERRIDES[1:], "checkpoint.deadline_margin_s=15"]
    runs = tmp_path / "runs"
    reference = run(["srun", "-N1", "-n2", *ddp_hpc_command(), "train", CONFIG, *common,
                     f"logging.run_dir={runs}", "logging.name=reference"], timeout=300, cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]

    # Only the first attempt is slowed down (20 epochs x 16 steps x 0.5 s: longer than a minute).
    slow = "callbacks=[{target: 'stop_helpers:SlowSteps', params: {seconds: 0.5}}]"
    train = shlex.join([*ddp_hpc_command(), "train", CONFIG, *common, f"logging.run_dir={runs}", "logging.name=deadline"])
    script = tmp_path / "deadline.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --job-name=deadline", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2",
        "#SBATCH --time=1", "#SBATCH --output=logs/%x-%j.out", "#SBATCH --open-mode=append", "#SBATCH --requeue",
        *SLURM_DEADLINE_LINES,
        'echo "test: DDP_HPC_DEADLINE=$DDP_HPC_DEADLINE"',
        "extra=()",
        f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then extra=({shlex.quote(slow)}); fi',
        # No --kill-on-bad-exit here: with it, the first rank to exit 75 gets the others
        # killed and srun reports 143 instead of 75.
        f'srun --wait=60 {train} "${{extra[@]}}"; status=$?',
        'echo "test: step ended with $status"',
        'if [ "$status" = 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$status"', ""]))
    env = clean_env({"PYTHONPATH": str(REPO / "tests")})
    (tmp_path / "logs").mkdir()
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, check=True).stdout.strip().split(";")[0]
    log_path = tmp_path / "logs" / f"deadline-{job_id}.out"
    wait_for(lambda: "PENDING" in job_state(job_id) and log_path.exists() and "step ended with 75" in log_path.read_text(),
             240, "the job to stop itself and requeue")
    first = log_path.read_text()
    deadline = float(re.search(r"test: DDP_HPC_DEADLINE=([\d.]+)", first).group(1))
    stopped = re.search(r"checkpointing and stopping at step (\d+)", first)
    assert stopped, first[-3000:]
    step = int(stopped.group(1))
    checkpoint = runs / "deadline" / "checkpoints" / f"step-{step:08d}.pt"
    checkpointed = checkpoint.stat().st_mtime
    assert checkpointed < deadline, "the checkpoint came after the time limit"
    release_requeued(job_id)
    wait_for(lambda: not job_state(job_id), 300, "the requeued job to finish", poll=1.0)
    log = log_path.read_text()
    assert "step ended with 0" in log, log[-3000:]
    assert re.search(rf"resuming from \S+step-{step:08d}\.pt:", log), log[-3000:]
    assert_same_training_state(load_checkpoint(runs / "reference" / "checkpoints" / "last.pt"),
                               load_checkpoint(runs / "deadline" / "checkpoints" / "last.pt"))
    FIGURES.append(f"deadline stop (sbatch --time=1, no signal, margin 15 s): checkpoint at step {step} "
                   f"{deadline - checkpointed:.1f} s before the time limit; requeued, final weights bit-identical")

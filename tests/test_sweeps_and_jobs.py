"""Sweeps as array jobs, and the job commands (status, logs, cancel), on the test cluster."""

from __future__ import annotations

import json
import re
import time

import pytest

from conftest import FAST_WAIT, REPO, ddp_hpc_command, run

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]
DIGITS = str(REPO / "configs" / "digits.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("variant", [["slurm"], ["slurm", "--sbatch"], ["pbs", "--cluster", "pbs-generic"]],
                         ids=["submitit", "sbatch", "qsub"])
def test_a_sweep_runs_as_one_array_job_and_wait_prints_every_element(variant, slurm_cluster, tmp_path):
    result = run([*ddp_hpc_command(), "submit", *variant, DIGITS, "--sweep", "training.lr=0.001,0.003",
                  "--nodes", "1", "--walltime", "10", *FAST_WAIT, "training.epochs=2", "logging.plot=false",
                  f"logging.run_dir={tmp_path / 'runs'}"], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = [line.split() for line in result.stdout.splitlines() if re.match(r"^[01] +training\.lr=", line)]
    assert [(row[0], row[1], row[2]) for row in table] == [
        ("0", "training.lr=0.001", "completed"), ("1", "training.lr=0.003", "completed")]
    summaries = [json.loads((tmp_path / "runs" / f"digits-{i}" / "summary.json").read_text()) for i in (0, 1)]
    assert [s["epochs_completed"] for s in summaries] == [2, 2]
    # Each element trained with its own learning rate (the resolved configs say so).
    configs = [(tmp_path / "runs" / f"digits-{i}" / "config.yaml").read_text() for i in (0, 1)]
    assert "lr: 0.001" in configs[0] and "lr: 0.003" in configs[1]
    record = json.loads((tmp_path / "runs" / "digits" / "submission.json").read_text())
    assert len(record["elements"]) == 2


def test_status_logs_and_cancel_on_a_running_job(slurm_cluster, tmp_path):
    submitted = run([*ddp_hpc_command(), "submit", "slurm", "--sbatch", "--nodes", "1", "--tasks-per-node", "1",
                     "--walltime", "5", "--job-name", "sleeper", "--", "sh", "-c",
                     "echo started; sleep 300"], cwd=tmp_path, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted job (\S+)", submitted.stdout).group(1)
    folder = tmp_path / "runs" / "sleeper"
    deadline = time.monotonic() + 120
    while True:  # wait until it runs and has written its first line
        status = run([*ddp_hpc_command(), "status", str(folder)], cwd=tmp_path)
        logs = run([*ddp_hpc_command(), "logs", job_id], cwd=tmp_path)
        if ": running" in status.stdout and "started" in logs.stdout:
            break
        assert time.monotonic() < deadline, status.stdout + status.stderr + logs.stdout + logs.stderr
        time.sleep(2)
    cancelled = run([*ddp_hpc_command(), "cancel", str(folder)], cwd=tmp_path)
    assert cancelled.returncode == 0 and f"cancel requested for job {job_id}" in cancelled.stdout
    deadline = time.monotonic() + 120
    while ": cancelled" not in (status := run([*ddp_hpc_command(), "status", job_id], cwd=tmp_path)).stdout:
        assert time.monotonic() < deadline, status.stdout + status.stderr
        time.sleep(2)


def test_job_commands_name_what_is_wrong(tmp_path):
    result = run([*ddp_hpc_command(), "status", "424242"], cwd=tmp_path)
    assert result.returncode == 2 and "neither a run folder nor a job id" in result.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "submission.json").write_text("{not json")
    result = run([*ddp_hpc_command(), "logs", str(tmp_path / "broken")], cwd=tmp_path)
    assert result.returncode == 2 and "is not a ddp_hpc submission record" in result.stderr


@pytest.mark.slow
@pytest.mark.reliability
@pytest.mark.timeout(900)
def test_a_chain_past_the_walltime_ends_bit_identical_to_one_long_run(slurm_cluster, tmp_path):
    """PBS's way past the walltime (no signal, no user requeue): each link of a 3-link chain
    stops ahead of its 1-minute walltime at an agreed step with a checkpoint, the next link
    resumes it, and the link that finds the run finished trains nothing."""
    from conftest import assert_same_training_state, clean_env
    from ddp_hpc.engine.checkpoint.files import load_checkpoint

    config = str(REPO / "configs" / "synthetic.yaml")
    common = ["job.params.samples=512", "job.params.val_samples=101", "job.params.input_dim=16",
              "job.params.hidden=32", "job.params.depth=2", "training.batch_size=16", "training.epochs=20",
              "training.deterministic=true", "logging.progress=never", "logging.plot=false",
              "checkpoint.preemption_check_every_n_steps=5", "validation.early_stopping.patience=null",
              "checkpoint.deadline_margin_s=20", f"logging.run_dir={tmp_path / 'runs'}"]
    reference = run([*ddp_hpc_command(), "launch", "--nproc", "2", "--", *ddp_hpc_command(), "train", config,
                     *common, "logging.name=reference"], cwd=tmp_path, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    # 320 steps of at least 0.15 s: longer than the 40 s one 1-minute link leaves before its
    # margin, shorter than two links (the third is there if start-up is slow).
    slow = "callbacks=[{target: 'stop_helpers:SlowSteps', params: {seconds: 0.15}}]"
    env = clean_env({"PYTHONPATH": str(REPO / "tests")})
    started = time.monotonic()
    result = run([*ddp_hpc_command(), "submit", "pbs", config, "--cluster", "pbs-generic", "--nodes", "1",
                  "--walltime", "1", "--chain", "3", "--wait", *common, "logging.name=chained", slow],
                 env=env, cwd=tmp_path, timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "chained" / "submission.json").read_text())
    assert len(record["chain"]) == 3
    logs = "".join(path.read_text() for path in sorted(tmp_path.glob("job.pbs.[oe]*")))
    stops = re.findall(r"checkpointing and stopping at step (\d+)", logs)
    assert stops, logs[-3000:]  # at least one link stopped itself before its walltime
    assert_same_training_state(load_checkpoint(tmp_path / "runs" / "reference" / "checkpoints" / "last.pt"),
                               load_checkpoint(tmp_path / "runs" / "chained" / "checkpoints" / "last.pt"))
    from conftest import FIGURES

    FIGURES.append(f"chain of 3 x 1-minute PBS jobs (qsub): stopped itself at step(s) {', '.join(stops)}, "
                   f"{time.monotonic() - started:.0f}s in all; final weights bit-identical to one run")

"""Rendered scripts run for real: PBS with the variables PBS Pro sets, qsub through
Slurm's PBS wrappers, sbatch, submitit and torchrun-per-node on the two-node test cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_WAIT, REPO, clean_env, ddp_hpc_command, run

pytestmark = pytest.mark.multiproc
DIGITS = str(REPO / "configs" / "digits.yaml")
QUICK = ["training.epochs=3", "validation.early_stopping.patience=null", "logging.plot=false"]


def submit(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run([*ddp_hpc_command(), "submit", *args, f"logging.run_dir={tmp_path / 'runs'}", *QUICK],
               cwd=tmp_path, timeout=timeout)


def finished_summary(result, tmp_path: Path, name: str) -> dict:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "job finished: 3 epochs" in result.stdout
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


@pytest.mark.mpi
def test_pbs_script_runs_with_pbs_pro_variables(tmp_path, mpich):
    script = tmp_path / "job.pbs"
    rendered = run([*ddp_hpc_command(), "render", "pbs", DIGITS, "--cluster", "pbs-generic", "--nodes", "1",
                    "--walltime", "10", "-o", str(script), f"logging.run_dir={tmp_path / 'runs'}", *QUICK])
    assert rendered.returncode == 0, rendered.stderr
    nodefile = tmp_path / "PBS_NODEFILE"
    nodefile.write_text(f"{os.uname().nodename}\n")
    env = clean_env({"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path), "PBS_JOBID": "4242.pbs01",
                     "PBS_JOBNAME": "digits"})
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ddp_hpc: run folder {tmp_path / 'runs' / 'digits'}\n" in result.stdout
    summary = json.loads((tmp_path / "runs" / "digits" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs_completed"] == 3


@pytest.mark.slurm
def test_qsub_wait_on_two_nodes(tmp_path, slurm_cluster, qsub):
    result = submit(tmp_path, "pbs", DIGITS, "--cluster", "pbs-generic", "--nodes", "2", "--walltime", "10", *FAST_WAIT)
    summary = finished_summary(result, tmp_path, "digits")
    assert summary["world_size"] == 4
    assert (tmp_path / "runs" / "digits" / "job.pbs").exists()


@pytest.mark.slurm
def test_submitit_wait_on_two_nodes(tmp_path, slurm_cluster):
    result = submit(tmp_path, "slurm", DIGITS, "--nodes", "2", "--tasks-per-node", "2", "--walltime", "10", *FAST_WAIT)
    summary = finished_summary(result, tmp_path, "digits")
    assert summary["world_size"] == 4 and summary["epochs_run_per_rank"] == [3, 3, 3, 3]
    assert (tmp_path / "runs" / "digits" / "submitit").is_dir()


@pytest.mark.slurm
@pytest.mark.parametrize("variant", [[], ["--torchrun"]], ids=["srun-per-rank", "torchrun-per-node"])
def test_sbatch_script_wait_on_two_nodes(tmp_path, slurm_cluster, variant):
    result = submit(tmp_path, "slurm", DIGITS, "--nodes", "2", "--tasks-per-node", "2", "--walltime", "10",
                    "--sbatch", *variant, *FAST_WAIT)
    summary = finished_summary(result, tmp_path, "digits")
    assert summary["world_size"] == 4
    log = next((tmp_path / "logs").glob("digits-*.out")).read_text()
    assert "ddp_hpc: run folder" in log and "done: 3 epochs" in log


@pytest.mark.parametrize("scheduler", ["pbs", "slurm"])
def test_dry_run_prints_everything_and_submits_nothing(tmp_path, scheduler):
    result = submit(tmp_path, scheduler, DIGITS, "--nodes", "2", "--dry-run")
    assert result.returncode == 0, result.stderr
    if scheduler == "pbs":  # a script, and the qsub line
        assert result.stdout.startswith("#!/bin/bash") and "# would run: qsub " in result.stdout
    else:  # submitit: no script of ours, its parameters
        assert "# would submit with submitit, parameters:" in result.stdout and "#   nodes = 2" in result.stdout
    assert f"# per-rank command (4 ranks): ddp-hpc train {DIGITS}" in result.stdout
    assert "submitted job" not in result.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


def test_missing_qsub_names_the_rendered_script(tmp_path):
    env = {"PATH": f"{Path(sys.executable).parent}:/nonexistent"}
    result = run([*ddp_hpc_command(), "submit", "pbs", DIGITS, "--cluster", "pbs-generic", f"logging.run_dir={tmp_path}"], env=env, cwd=tmp_path)
    assert result.returncode == 2
    script = tmp_path / "digits" / "job.pbs"
    assert f"qsub not found on PATH: the rendered script is at {script}" in result.stderr
    assert script.exists()


@pytest.mark.parametrize("args,fragment", [
    (["render", "pbs", DIGITS, "--cluster", "nosuch"], "unknown cluster profile 'nosuch'"),
    (["render", "pbs", DIGITS, "--cluster", "aurora", "--ranks-per-node", "13"], "13 ranks per node"),
    (["render", "slurm", DIGITS, "--cluster", "aurora"], "'aurora' is a pbs cluster"),
    (["render", "pbs", DIGITS, "--cluster", "pbs-generic", "--walltime", "soon"], "--walltime 'soon'"),
    (["render", "pbs", DIGITS, "--cluster", "pbs-generic", "--nodes", "0"], "--nodes 0 must be >= 1"),
    (["render", "pbs", DIGITS, "--cluster", "pbs-generic", "--env", "1BAD=x"], "--env '1BAD=x' is not NAME=VALUE"),
    (["render", "pbs", DIGITS, "--cluster", "pbs-generic", "training.lr=-1"], "training.lr must be > 0"),
    (["port"], "no job id"),
])
def test_bad_scheduler_input_exits_2(args, fragment):
    result = run([*ddp_hpc_command(), *args])
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr

"""``ddp-hpc env`` and ``doctor`` under real launchers: torchrun, Open MPI, MPICH, srun."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ddp_hpc_command, run

pytestmark = pytest.mark.multiproc


def _json_lines(stdout: str) -> list[dict]:
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])


def _assert_two_local_ranks(records: list[dict], source: str) -> None:
    assert [r["rank"] for r in records] == [0, 1]
    assert [r["local_rank"] for r in records] == [0, 1]
    assert {r["world_size"] for r in records} == {2}
    assert {r["source"] for r in records} == {source}
    assert len({r["master_port"] for r in records}) == 1


def _assert_doctor_ok(result, ranks: int, nodes: int) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    table = [line for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert len(table) == ranks, result.stdout
    assert len({line.split()[2] for line in table}) == nodes
    assert f"doctor: OK: {ranks} ranks on {nodes} node(s)" in result.stdout


@pytest.mark.mpi
def test_env_under_mpich(mpich):
    result = run([mpich, "-n", "2", *ddp_hpc_command(), "env", "--json"])
    assert result.returncode == 0, result.stderr
    _assert_two_local_ranks(_json_lines(result.stdout), "mpich")


@pytest.mark.mpi
def test_env_under_openmpi(openmpi):
    result = run([openmpi, "-n", "2", "--oversubscribe", *ddp_hpc_command(), "env", "--json"])
    assert result.returncode == 0, result.stderr
    _assert_two_local_ranks(_json_lines(result.stdout), "openmpi")


@pytest.mark.mpi
def test_doctor_under_mpich_with_python_m(mpich):
    result = run([mpich, "-n", "2", sys.executable, "-m", "ddp_hpc", "doctor"])
    _assert_doctor_ok(result, ranks=2, nodes=1)


@pytest.mark.mpi
def test_doctor_under_openmpi(openmpi):
    result = run([openmpi, "-n", "2", "--oversubscribe", *ddp_hpc_command(), "doctor"])
    _assert_doctor_ok(result, ranks=2, nodes=1)


def test_doctor_under_torchrun():
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "-m", "ddp_hpc", "doctor"])
    _assert_doctor_ok(result, ranks=2, nodes=1)


@pytest.mark.slurm
def test_doctor_under_srun_on_two_nodes(slurm_cluster):
    result = run(["srun", "-N2", "-n4", "--ntasks-per-node=2", *ddp_hpc_command(), "doctor"], timeout=180)
    _assert_doctor_ok(result, ranks=4, nodes=2)


@pytest.mark.slurm
def test_env_under_srun(slurm_cluster):
    result = run(["srun", "-N2", "-n2", *ddp_hpc_command(), "env", "--json"], timeout=120)
    assert result.returncode == 0, result.stderr
    records = _json_lines(result.stdout)
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in records] == [(0, 0, 0), (1, 1, 0)]
    assert {r["master_addr"] for r in records} == {"n1"}


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", ["torchrun", "openmpi", "mpich"])
def test_launch_subcommand_runs_doctor(launcher, request):
    if launcher != "torchrun":
        request.getfixturevalue(launcher)
    result = run([*ddp_hpc_command(), "launch", "--nproc", "2", "--launcher", launcher, "--",
                  *ddp_hpc_command(), "doctor"])
    _assert_doctor_ok(result, ranks=2, nodes=1)


def test_main_job_command_trains_digits_to_95_percent(tmp_path):
    """The README's main-job command, with the full digits config."""
    result = run(["scripts/run_ddp_local.sh", "2", f"logging.run_dir={tmp_path}"],
                 env={"DDP_HPC_VENV": str(sys.prefix)}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run folder: {tmp_path}/digits" in result.stdout
    # The last line names the training curves it drew (matplotlib comes with the examples extra).
    assert result.stdout.splitlines()[-1] == f"training curves: {tmp_path}/digits/curves.png"
    assert (tmp_path / "digits" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["test"]["accuracy"] >= 0.95


def test_local_script_refuses_a_bad_nproc():
    result = run(["scripts/run_ddp_local.sh", "two"])
    assert result.returncode == 2
    assert "NPROC must be a positive integer" in result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", ["mpich", "openmpi", "srun"])
def test_the_same_training_config_runs_under_each_launcher(launcher, request, tmp_path):
    if launcher == "srun":
        request.getfixturevalue("slurm_cluster")
        prefix = ["srun", "-n", "2"]
    else:
        program = request.getfixturevalue(launcher)
        prefix = [program, "-n", "2", *(["--oversubscribe"] if launcher == "openmpi" else [])]
    result = run([*prefix, *ddp_hpc_command(), "train", "configs/digits.yaml", "training.epochs=2",
                  "logging.plot=false", f"logging.run_dir={tmp_path}"], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs_run_per_rank"] == [2, 2]

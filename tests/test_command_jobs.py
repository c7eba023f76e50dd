"""Any command on any launcher: ``ddp-hpc run`` gives it torchrun's worker variables, and
command jobs go through every scheduler path. The example scripts are the commands."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from conftest import FAST_WAIT, REPO, clean_env, ddp_hpc_command, run
from ddp_hpc.device import DeviceChoice
from ddp_hpc.environment import DistEnv, resolve_env
from ddp_hpc.errors import UserError
from ddp_hpc.run.torchrun_env import omp_threads, worker_environment

PLAIN = str(REPO / "examples" / "plain_ddp.py")
WITH_API = str(REPO / "examples" / "with_api.py")
PROBE = str(REPO / "tests" / "scripts" / "probe_torchrun_env.py")
CPU = DeviceChoice("cpu", "gloo", None)
RESULT = re.compile(r"^rank (\d+)/(\d+) local_rank (\d+): all_reduce correct=(\d+) total=(\d+)", re.M)

# ----- the variables (pure) ---------------------------------------------------------------------

MPICH_RANK_3 = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                "PMI_FD": "5", "HYDI_CONTROL_FD": "6", "MASTER_ADDR": "node1", "MASTER_PORT": "29400",
                "PBS_JOBID": "77.pbs"}


def test_mpich_rank_gets_every_torchrun_worker_variable():
    dist_env = resolve_env(MPICH_RANK_3)
    launch = worker_environment(["python", "train.py"], dist_env, CPU, MPICH_RANK_3, cpus=8)
    assert launch.argv == ("python", "train.py")
    assert {k: launch.exported[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                                            "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default",
        "MASTER_ADDR": "node1", "MASTER_PORT": "29400"}
    assert launch.exported["TORCHELASTIC_RUN_ID"] == "77.pbs"  # Hydra names no launch of its own
    assert launch.exported["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 of the command serves
    assert launch.exported["DDP_HPC_DEVICE"] == "cpu" and launch.exported["DDP_HPC_BACKEND"] == "gloo"
    assert launch.exported["OMP_NUM_THREADS"] == "4"  # 8 CPUs shared by 2 ranks on the node
    # What the command sees resolves to the same place (ddp_hpc inside the command agrees).
    inner = resolve_env(launch.environment(MPICH_RANK_3))
    assert (inner.rank, inner.world_size, inner.local_rank, inner.node_rank) == (3, 4, 1, 1)


def test_under_torchrun_only_the_flight_recorder_is_switched_on():
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    launch = worker_environment(["python", "t.py"], resolve_env(env), CPU, env)
    assert launch.exported == {"TORCH_FR_BUFFER_SIZE": "16"}
    # A size the user chose is kept.
    assert worker_environment(["python", "t.py"], resolve_env(env), CPU,
                              {**env, "TORCH_FR_BUFFER_SIZE": "8"}).exported == {}


def test_omp_threads_respects_the_launchers_binding(monkeypatch):
    cpus = os.cpu_count() or 1
    assert omp_threads(4, {}, cpus_visible=cpus) == max(1, cpus // 4)  # this host, nothing bound: a fair share
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a 64-CPU node
    assert omp_threads(4, {}, cpus_visible=64) == 16  # four ranks share all 64
    assert omp_threads(4, {}, cpus_visible=6) == 6  # bound to 6 of the 64 by the launcher: all 6 are this rank's
    assert omp_threads(4, {"SLURM_CPUS_PER_TASK": "7"}, cpus_visible=64) == 7
    assert omp_threads(8, {}, cpus_visible=1) == 1


def test_an_existing_omp_num_threads_is_kept_and_a_bad_restart_count_refused():
    env = {**MPICH_RANK_3, "OMP_NUM_THREADS": "3"}
    assert "OMP_NUM_THREADS" not in worker_environment(["x"], resolve_env(env), CPU, env, cpus=8).exported
    with pytest.raises(UserError, match="DDP_HPC_RESTART_COUNT"):
        bad = {**MPICH_RANK_3, "DDP_HPC_RESTART_COUNT": "two"}
        worker_environment(["x"], resolve_env(bad), CPU, bad)


# ----- the shim under real launchers ------------------------------------------------------------

def _results(stdout: str, world_size: int) -> list[tuple[int, ...]]:
    rows = sorted(tuple(map(int, m)) for m in RESULT.findall(stdout))
    assert [r[0] for r in rows] == list(range(world_size)), stdout
    assert {r[1] for r in rows} == {world_size}
    assert len({(r[3], r[4]) for r in rows}) == 1, "ranks disagree on the all_reduce"
    assert rows[0][4] == 297  # every test sample counted once
    return rows


def test_shim_errors_are_one_line_and_exit_2_before_the_command_starts(tmp_path):
    marker = tmp_path / "ran"
    result = run([*ddp_hpc_command(), "run", "--", "touch", str(marker)],
                 env={"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2",
                      "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "2"})
    assert result.returncode == 2 and not marker.exists()
    assert result.stderr.count("\n") == 1 and "launcher variables disagree" in result.stderr
    missing = run([*ddp_hpc_command(), "run", "--", "no-such-program-xyz"])
    assert missing.returncode == 127 and "cannot run 'no-such-program-xyz'" in missing.stderr


def test_exec_passes_the_exit_status_and_the_pid_through():
    result = run([*ddp_hpc_command(), "run", "--", "sh", "-c", 'echo "pid $$ rank $RANK"; exit 7'])
    assert result.returncode == 7
    assert re.search(r"pid \d+ rank 0", result.stdout)


@pytest.mark.multiproc
@pytest.mark.parametrize("script", [PLAIN, WITH_API], ids=["plain", "api"])
def test_examples_under_torchrun_without_ddp_hpc_run(script, tmp_path):
    import sys

    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
                 timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _results(result.stdout, 2)


# Each example under one MPI and each MPI once: the plain example under MPICH runs in
# tests/test_stacks.py on every torch, the API's launcher detection in test_launch_real.py's doctors.
@pytest.mark.mpi
@pytest.mark.multiproc
@pytest.mark.parametrize("launcher, script", [("openmpi", PLAIN), ("mpich", WITH_API)], ids=["openmpi-plain", "mpich-api"])
def test_examples_under_mpiexec(launcher, script, request, tmp_path):
    program = request.getfixturevalue(launcher)
    shim = [*ddp_hpc_command(), "run", "--"] if script == PLAIN else []
    extra = ["--oversubscribe"] if launcher == "openmpi" else []
    result = run([program, "-n", "3", *extra, *shim, "python", script], timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _results(result.stdout, 3)


@pytest.mark.slurm
@pytest.mark.multiproc
def test_srun_cyclic_places_ranks_as_slurm_did_and_frameworks_see_it(slurm_cluster, tmp_path):
    srun = ["srun", "-N2", "-n4", "--distribution=cyclic"]
    probe = run([*srun, *ddp_hpc_command(), "run", "--", "python", PROBE], timeout=240, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    seen = sorted((json.loads(line) for line in probe.stdout.splitlines()), key=lambda r: int(r["RANK"]))
    assert [int(r["RANK"]) for r in seen] == [0, 1, 2, 3] and {r["WORLD_SIZE"] for r in seen} == {"4"}
    for record in seen:  # what the framework sees is where Slurm put the task
        slurm = record["slurm"]
        assert (record["RANK"], record["LOCAL_RANK"], record["GROUP_RANK"]) == (
            slurm["SLURM_PROCID"], slurm["SLURM_LOCALID"], slurm["SLURM_NODEID"])
        assert record["GROUP_WORLD_SIZE"] == "2"
        assert record["lightning_torchelastic"] and record["is_torchelastic_launched"]
    # cyclic: consecutive ranks go to different nodes.
    assert seen[0]["slurm_node"] != seen[1]["slurm_node"]
    # Those variables alone form the group across both nodes (the plain example trains on
    # `srun ddp-hpc run` in the sbatch command job below).
    assert {r["all_reduce_of_rank_plus_one"] for r in seen} == {1 + 2 + 3 + 4}
    api = run([*srun, "python", WITH_API], timeout=300, cwd=tmp_path)
    assert api.returncode == 0, api.stderr[-3000:]
    _results(api.stdout, 4)


# ----- command jobs through the schedulers -----------------------------------------------------

def submit(tmp_path: Path, *args: str, timeout: float = 400):
    return run([*ddp_hpc_command(), "submit", *args], cwd=tmp_path, timeout=timeout)


@pytest.mark.slurm
@pytest.mark.multiproc
@pytest.mark.slow
# The plain script on every path; the API example (which passed all three by hand) on the
# PBS one. Two nodes each; two ranks per node once (the rest is CPU time: four ranks
# importing torch on two cores).
@pytest.mark.parametrize("variant,script,per_node", [
    (["slurm"], PLAIN, 1), (["slurm", "--sbatch"], PLAIN, 1), (["pbs", "--cluster", "pbs-generic"], PLAIN, 2),
    (["pbs", "--cluster", "pbs-generic"], WITH_API, 1)], ids=["submitit-plain", "sbatch-plain", "qsub-plain", "qsub-api"])
def test_command_job_waits_for_the_end_and_reports_it(variant, script, per_node, slurm_cluster, tmp_path):
    result = submit(tmp_path, *variant, "--nodes", "2", "--tasks-per-node", str(per_node), "--walltime", "10",
                    *FAST_WAIT, "--job-name", "example", "--", "python", script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = re.search(r"submitted job (\S+)", result.stdout).group(1)
    assert f"job {job_id}: completed (exit status 0" in result.stdout
    record = json.loads((tmp_path / "runs" / "example" / "submission.json").read_text())
    assert record["job_id"] == job_id and record["kind"] == "command"
    if variant[-1] != "slurm":  # batch scripts: the ranks' lines are in the job log, echoed as its tail
        _results(result.stdout, 2 * per_node)


@pytest.mark.slurm
@pytest.mark.multiproc
@pytest.mark.parametrize("variant", [["slurm", "--sbatch"], ["pbs", "--cluster", "pbs-generic"]],
                         ids=["sbatch", "qsub"])
def test_a_command_failing_on_one_rank_fails_the_wait(variant, slurm_cluster, tmp_path):
    # One write per line: print() writes "rank", " ", "1" and "\n" separately when unbuffered,
    # and two ranks' pieces then interleave in the job log ("rankrank 0\n 1").
    fail = ('import os, sys; os.write(1, f"rank {os.environ[\'RANK\']}\\n".encode()); '
            'sys.exit(3 if os.environ["RANK"] == "1" else 0)')
    result = submit(tmp_path, *variant, "--nodes", "1", "--tasks-per-node", "2", "--walltime", "5", *FAST_WAIT,
                    "--job-name", "fails", "--", "python", "-c", fail)
    job_id = re.search(r"submitted job (\S+)", result.stdout).group(1)
    assert result.returncode != 0
    assert result.stderr.startswith(f"ddp-hpc: error: job {job_id} failed")
    assert "rank 1" in result.stderr  # the log's tail


@pytest.mark.slurm
def test_wait_and_status_without_sacct(slurm_cluster, tmp_path):
    """A cluster without accounting: sacct fails; squeue/scontrol and the exit file still tell."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    (fake / "sacct").chmod(0o755)
    env = clean_env({"PATH": f"{fake}:{clean_env()['PATH']}"})
    result = run([*ddp_hpc_command(), "submit", "slurm", "--sbatch", "--nodes", "1", "--tasks-per-node", "1",
                  "--walltime", "5", *FAST_WAIT, "--job-name", "nosacct", "--", "sh", "-c", "echo hello; exit 4"],
                 env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "hello" in result.stderr and "sacct" not in result.stdout.split("job ")[-1].split(")")[0]
    status = run([*ddp_hpc_command(), "status", str(tmp_path / "runs" / "nosacct")], env=env, cwd=tmp_path)
    assert status.returncode == 0 and "failed, exit status 4" in status.stdout, status.stdout + status.stderr

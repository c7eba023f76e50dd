"""The rank-environment resolver against recorded and documented launcher variables."""

from __future__ import annotations

import os
import socket

import pytest

import launch_records as rec
from ddp_hpc.environment import PortRange, resolve_env
from ddp_hpc.environment.launchers import expand_tasks_per_node
from ddp_hpc.errors import EnvironmentConflictError, UserError

# (case, env, expected (source, rank, world, local_rank, local_world, node_rank, num_nodes))
CASES = [
    ("torchrun", rec.TORCHRUN_RANK1, ("torchrun", 1, 2, 1, 2, 0, 1)),
    ("openmpi", rec.OPENMPI_RANK1, ("openmpi", 1, 2, 1, 2, 0, 1)),
    ("mpich", rec.MPICH_RANK1, ("mpich", 1, 2, 1, 2, 0, 1)),
    ("srun rank 3, alone on node 1", rec.SRUN_RANK3, ("slurm", 3, 4, 0, 1, 1, 2)),
    ("srun rank 2, third on node 0", rec.SRUN_RANK2, ("slurm", 2, 4, 2, 3, 0, 2)),
    ("sbatch shell is one process", rec.SBATCH_SHELL, ("single", 0, 1, 0, 1, 0, 1)),
    ("openmpi inside sbatch", rec.OPENMPI_IN_SBATCH_RANK1, ("openmpi", 1, 2, 0, 1, 1, 2)),
    ("torchrun per node under srun", rec.TORCHRUN_UNDER_SRUN_RANK3, ("torchrun", 3, 4, 1, 2, 1, 2)),
    ("pals on aurora", rec.PALS_AURORA_RANK13, ("pals", 13, 24, 1, 12, 1, 2)),
    ("intel mpi", rec.INTEL_MPI_RANK6, ("mpich", 6, 8, 2, 4, 1, 2)),
    ("mvapich", rec.MVAPICH_RANK2, ("mvapich", 2, 4, 0, 2, 1, 2)),
    ("nothing", {}, ("single", 0, 1, 0, 1, 0, 1)),
    ("hand-set env:// variables", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0",
                                   "MASTER_PORT": "1234"}, ("env", 1, 2, 1, 2, 0, 1)),
    ("wrapper exporting RANK from PMI_RANK", {**rec.MPICH_RANK1, "RANK": "1", "WORLD_SIZE": "2"},
     ("mpich", 1, 2, 1, 2, 0, 1)),
]


@pytest.mark.parametrize("case,env,expected", CASES, ids=[c[0] for c in CASES])
def test_resolves_recorded_launches(case, env, expected):
    env = {"PBS_NODEFILE": "", **env}
    if expected[6] > 1 and not any(k in env for k in ("MASTER_ADDR", "SLURM_JOB_NODELIST")):
        env["MASTER_ADDR"] = "node0"
    if expected[6] > 1 and not any(k in env for k in ("SLURM_JOB_ID", "PBS_JOBID", "TORCHELASTIC_RUN_ID")):
        env["MASTER_PORT"] = "29500"
    resolved = resolve_env(env)
    got = (resolved.source, resolved.rank, resolved.world_size, resolved.local_rank,
           resolved.local_world_size, resolved.node_rank, resolved.num_nodes)
    assert got == expected


def test_conflicting_rank_variables_name_both():
    env = {**rec.MPICH_RANK1, "RANK": "0", "WORLD_SIZE": "2"}
    with pytest.raises(EnvironmentConflictError) as err:
        resolve_env(env)
    message = str(err.value)
    assert "mpich says rank 1 of 2" in message and "PMI_RANK" in message
    assert "env says rank 0 of 2" in message and "RANK" in message


def test_two_mpi_flavours_that_disagree_are_an_error():
    env = {**rec.OPENMPI_RANK1, "MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2",
           "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(EnvironmentConflictError, match="openmpi says rank 1 of 2.*mvapich says rank 0 of 2"):
        resolve_env(env)


def test_slurm_step_and_hand_set_rank_that_disagree_are_an_error():
    with pytest.raises(EnvironmentConflictError, match="slurm says rank 3 of 4.*env says rank 0"):
        resolve_env({**rec.SRUN_RANK3, "RANK": "0", "WORLD_SIZE": "4"})


@pytest.mark.parametrize("env,fragment", [
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "OMPI_COMM_WORLD_RANK='x' is not an integer"),
    ({"PMI_RANK": "3", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
     "rank 3 outside [0, 2)"),
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PALS_LOCAL_SIZE": "1"}, "without PMI_SIZE"),
    ({**rec.SRUN_RANK3, "SLURM_STEP_TASKS_PER_NODE": "two"}, "tasks-per-node list 'two'"),
])
def test_malformed_variables_are_named(env, fragment):
    with pytest.raises(UserError) as err:
        resolve_env(env)
    assert fragment in str(err.value)


@pytest.mark.parametrize("spec,expected", [
    ("2(x3),1", [2, 2, 2, 1]), ("3,1", [3, 1]), ("4", [4]), ("1(x2)", [1, 1]),
])
def test_tasks_per_node(spec, expected):
    assert expand_tasks_per_node(spec) == expected


class TestMasterAddr:
    def test_master_addr_variable_wins(self):
        assert resolve_env({**rec.SRUN_RANK3, "MASTER_ADDR": "head"}).master_addr == "head"

    def test_first_host_of_slurm_node_list(self):
        env = {**rec.SRUN_RANK3, "SLURM_STEP_NODELIST": "gpu[007-009,12]"}
        assert resolve_env(env).master_addr == "gpu007"

    def test_first_line_of_pbs_nodefile_with_suffix(self, tmp_path):
        nodefile = tmp_path / "nodes"
        nodefile.write_text("x4102c5s0b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov\n" * 12
                            + "x4102c5s1b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov\n" * 12)
        env = {**rec.PALS_AURORA_RANK13, "PBS_NODEFILE": str(nodefile)}
        assert resolve_env(env).master_addr == "x4102c5s0b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov"
        assert resolve_env(env, host_suffix="-hsn0").master_addr == "x4102c5s0b0n0-hsn0"

    def test_suffix_from_environment_variable(self):
        env = {**rec.SRUN_RANK3, "DDP_HPC_HOST_SUFFIX": "-ib"}
        assert resolve_env(env).master_addr == "n1-ib"

    def test_single_node_uses_loopback(self):
        assert resolve_env(rec.MPICH_RANK1).master_addr == "127.0.0.1"

    def test_several_nodes_without_a_host_source_is_an_error(self):
        with pytest.raises(UserError, match="ranks span 2 nodes.*MASTER_ADDR"):
            resolve_env({**rec.INTEL_MPI_RANK6, "MASTER_PORT": "1234"})

    def test_unreadable_nodefile_is_named(self, tmp_path):
        env = {**rec.PALS_AURORA_RANK13, "PBS_NODEFILE": str(tmp_path / "missing")}
        with pytest.raises(UserError, match="cannot read PBS_NODEFILE .*missing"):
            resolve_env(env)


class TestMasterPort:
    def test_master_port_variable_wins(self):
        assert resolve_env({**rec.SRUN_RANK3, "MASTER_PORT": "31337"}).master_port == 31337

    @pytest.mark.parametrize("raw", ["0", "70000", "http", "-5"])
    def test_bad_master_port_is_refused(self, raw):
        with pytest.raises(UserError, match="MASTER_PORT"):
            resolve_env({"MASTER_PORT": raw})

    def test_same_job_same_port_on_every_rank(self):
        assert resolve_env(rec.SRUN_RANK3).master_port == resolve_env(rec.SRUN_RANK2).master_port

    @pytest.mark.reliability
    def test_consecutive_jobs_get_different_ports_inside_the_range(self):
        port_range = PortRange(20000, 20099)
        ports = {resolve_env({**rec.SRUN_RANK3, "SLURM_JOB_ID": str(job)}, port_range=port_range).master_port
                 for job in range(1000, 1100)}
        assert len(ports) == 100
        assert min(ports) >= 20000 and max(ports) <= 20099

    def test_pbs_job_id_with_server_name(self, tmp_path):
        nodefile = tmp_path / "nodes"
        nodefile.write_text("x1\nx2\n")
        env = {**rec.PALS_AURORA_RANK13, "PBS_NODEFILE": str(nodefile)}
        port = resolve_env(env).master_port
        assert PortRange().low <= port <= PortRange().high
        assert port == resolve_env({**env, "PALS_RANKID": "0", "PMI_RANK": "0", "PALS_NODEID": "0",
                                    "PALS_LOCAL_RANKID": "0"}).master_port

    def test_single_node_mpich_ranks_agree_through_their_shared_parent(self):
        rank0 = {**rec.MPICH_RANK1, "PMI_RANK": "0", "MPI_LOCALRANKID": "0"}
        assert resolve_env(rank0).master_port == resolve_env(rec.MPICH_RANK1).master_port

    def test_multi_node_launch_without_job_id_needs_master_port(self):
        with pytest.raises(UserError, match="export MASTER_PORT"):
            resolve_env({**rec.INTEL_MPI_RANK6, "MASTER_ADDR": "head"})

    def test_single_process_gets_a_free_port(self):
        port = resolve_env({}).master_port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # OSError (address in use) if the port was taken
            sock.listen()

    def test_port_range_outside_bounds_is_refused(self):
        with pytest.raises(UserError, match="port range"):
            PortRange(80, 90)


def test_resolve_reads_os_environ_by_default(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("OMPI_", "PMI", "SLURM_", "PALS_", "MV2_", "TORCHELASTIC", "PBS_")) \
                or name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_env().source == "env"


def test_the_job_is_named_once_by_the_launcher_class(capsys):
    """Port, torchrun's run id, the rendezvous marker and ``ddp-hpc port`` all ask the
    launcher class: with Slurm's PBS wrappers both job ids are set, and SLURM_JOB_ID wins
    everywhere (``ddp-hpc port`` read PBS_JOBID first before)."""
    import argparse

    from ddp_hpc.device import DeviceChoice
    from ddp_hpc.environment import derive_port, detect_launcher
    from ddp_hpc.schedulers.commands import cmd_port
    from ddp_hpc.startup.rendezvous import job_identity
    from ddp_hpc.run.torchrun_env import worker_environment

    env = {**rec.OPENMPI_IN_SBATCH_RANK1, "SLURM_JOB_ID": "41", "PBS_JOBID": "41.pbs", "MASTER_ADDR": "n1"}
    launcher = detect_launcher(env)
    assert (launcher.name, launcher.job_id(env), launcher.launch_id(env)) == ("openmpi", "41", "41|3287547905")
    dist_env = resolve_env(env)
    assert dist_env.master_port == derive_port("41|3287547905", PortRange())
    exported = worker_environment(["x"], dist_env, DeviceChoice("cpu", "gloo", None), env, cpus=2).exported
    assert exported["TORCHELASTIC_RUN_ID"] == "41|3287547905"
    assert job_identity(dist_env, env) == "world_size=2 launcher=openmpi SLURM_JOB_ID=41 PMIX_NAMESPACE=3287547905"
    os_environ = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "PBS_JOBID")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", {**os_environ, "SLURM_JOB_ID": "41", "PBS_JOBID": "41.pbs"})
        cmd_port(argparse.Namespace(job_id=None))
    assert capsys.readouterr().out.strip() == str(derive_port("41", PortRange()))


@pytest.mark.parametrize("env,expected", [
    ({**rec.MPICH_RANK1, "PMI_FD": "7"}, ("pmi", "7")),
    ({**rec.SRUN_RANK3, "SLURM_JOB_ID": "17", "SLURM_STEP_ID": "2"},
     ("command", ["scancel", "--ctld", "--quiet", "--signal=KILL", "17.2"])),
    (rec.TORCHRUN_RANK1, None),
    (rec.OPENMPI_RANK1, None),
])
def test_each_launcher_class_says_how_to_end_every_rank(env, expected):
    from ddp_hpc.environment import detect_launcher

    assert detect_launcher(env).abort_request(env) == expected

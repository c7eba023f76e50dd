"""``ddp-hpc cluster probe|check|which``: the schedulers' answers parsed from recorded outputs
(tests/data/cluster_probe, README there says which were recorded), the profile written from
them, the check's one line per mismatch, the profile found without ``--cluster``; then the
same against the real test cluster (two partitions, GPU GRES), with a 2-node job."""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import REPO, ddp_hpc_command, run
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.schedulers.cluster.check import check_profile
from ddp_hpc.schedulers import registry
from ddp_hpc.schedulers.cluster.node import read_node
from ddp_hpc.schedulers.cluster.probe import probe, profile_text
from ddp_hpc.schedulers.facts import ClusterFacts, Gpus, Partition, duration_s
from ddp_hpc.schedulers.pbs import probe as pbs_probe
from ddp_hpc.schedulers.slurm import probe as slurm_probe
from ddp_hpc.specs.profiles import ClusterProfile, Machine, ProfileMatch, find_profile, load_profile

DATA = REPO / "tests" / "data" / "cluster_probe"


def recorded(**files: str):
    """A fake runner: each command answers with its recorded file, any other with None."""
    answers = {
        slurm_probe.CONFIG_ARGV: files.get("config"), slurm_probe.SINFO_ARGV: files.get("sinfo"),
        slurm_probe.assoc_argv("alice"): files.get("assoc"), pbs_probe.SERVER_ARGV: files.get("server"),
        pbs_probe.QUEUES_ARGV: files.get("queues"), pbs_probe.NODES_ARGV: files.get("nodes"),
    }

    def runner(argv):
        name = answers.get(tuple(argv))
        return (DATA / name).read_text() if name else None
    return runner


TEST_CLUSTER = dict(config="slurm-scontrol-show-config.txt", sinfo="slurm-sinfo.txt", assoc="slurm-sacctmgr-assoc.txt")
WRAPPERS = dict(queues="pbs-wrappers-qstat-Q-f.txt", nodes="pbs-wrappers-pbsnodes-a.txt")
PBS_PRO = dict(server="pbspro-qstat-B-f.txt", queues="pbspro-qstat-Q-f.txt", nodes="pbspro-pbsnodes-a.txt")


def no_program(name: str) -> str | None:
    return None


def test_slurm_partitions_from_the_test_clusters_recorded_answers():
    facts = slurm_probe.read_cluster(recorded(**TEST_CLUSTER), "alice")
    assert facts.cluster_name == "ddphpc"
    assert facts.partitions == (
        Partition("debug", nodes=2, cpus=4, memory_mb=1, gpus=None, time_limit_s=None, time_limit="infinite",
                  default=True),
        Partition("gpu", nodes=2, cpus=4, memory_mb=1, gpus=Gpus(4, "a100"), time_limit_s=7200,
                  time_limit="2:00:00"))
    assert facts.accounts == ("root",) and facts.notes == ()


def test_slurm_partition_of_two_node_sizes_keeps_the_smaller_and_says_so():
    partitions, notes = slurm_probe.parse_sinfo((DATA / "slurm-big-sinfo.txt").read_text())
    batch = partitions[0]
    assert (batch.name, batch.nodes, batch.cpus, batch.memory_mb, batch.gpus, batch.time_limit_s, batch.default) == \
        ("batch", 12, 64, 256000, Gpus(4, "a100"), 86400, True)
    assert notes == ("partition batch has nodes of more than one size: the smallest is written",)


@pytest.mark.parametrize("text, gpus", [("gpu:a100:4", Gpus(4, "a100")), ("gpu:4(S:0-1)", Gpus(4, "")),
                                        ("nvme:1,gpu:MI250X:8(S:0-7)", Gpus(8, "mi250x")), ("(null)", None),
                                        ("nvme:1", None)])
def test_gres_strings(text, gpus):
    assert slurm_probe.parse_gres(text) == gpus


@pytest.mark.parametrize("text, seconds", [("infinite", None), ("UNLIMITED", None), ("30", 1800),
                                           ("30:00", 1800), ("2:00:00", 7200), ("1-00:00:00", 86400),
                                           ("1-02", 93600), ("1-02:30", 95400)])
def test_time_limits(text, seconds):
    assert duration_s(text) == seconds


def test_what_no_command_answered_is_a_note_never_a_value():
    facts = slurm_probe.read_cluster(recorded(sinfo="slurm-sinfo.txt"), "alice")
    assert (facts.cluster_name, facts.accounts) == (None, None)
    text = profile_text(probe("slurm", recorded(sinfo="slurm-sinfo.txt"), user="alice", environ={},
                              which=no_program, host="login1"))
    data = yaml.safe_load(text)
    assert "match" not in data and "account" not in data
    assert "# not learned: the cluster's name" in text
    assert "# not learned: accounts: `sacctmgr show assoc user=alice` did not answer" in text
    assert "# not learned: the launcher (no srun on PATH)" in text
    assert "# not learned: the node's own GPUs and network interfaces (the probe ran outside a job)" in text


def _loads(text: str, tmp_path: Path) -> ClusterProfile:
    path = tmp_path / "probed.yaml"
    path.write_text(text)
    return load_profile(str(path))


def test_probed_profile_of_the_test_cluster_loads_with_its_default_partition(tmp_path):
    found = probe("slurm", recorded(**TEST_CLUSTER), user="alice", environ={}, which=lambda n: f"/usr/bin/{n}",
                  host="vm")
    profile = _loads(profile_text(found), tmp_path)
    assert (profile.scheduler, profile.launcher, profile.queue, profile.account) == ("slurm", "srun", "debug", "root")
    assert (profile.ranks_per_node, profile.devices_per_node, profile.device, profile.backend,
            profile.cpus_per_task) == (1, 0, "cpu", "gloo", 4)
    assert profile.match == ProfileMatch(cluster_name="ddphpc")
    assert "# for gpu (--partition gpu" in profile_text(found) and "device: cuda, backend: nccl" in profile_text(found)


def test_pbs_through_slurms_wrappers_says_what_they_do_not_answer(tmp_path):
    facts = pbs_probe.read_cluster(recorded(**WRAPPERS))
    assert [p.name for p in facts.partitions] == ["debug", "gpu"]
    assert facts.cluster_name is None and facts.default_partition is None and facts.accounts is None
    assert any("`qstat -B -f` did not answer (Slurm's PBS wrappers do not)" in n for n in facts.notes)
    assert any("queue gpu: no walltime limit said" in n for n in facts.notes)
    text = profile_text(probe("pbs", recorded(**WRAPPERS), user="alice", environ={}, which=no_program, host="vm"))
    profile = _loads(text, tmp_path)
    assert profile.queue is None and "# not learned: the default queue; set queue: to one of debug, gpu" in text


def test_pbs_pro_queues_gpus_and_default_queue(tmp_path):
    facts = pbs_probe.read_cluster(recorded(**PBS_PRO))
    assert facts.cluster_name == "pbs01"
    assert facts.default_partition == Partition("workq", nodes=2, cpus=64, gpus=Gpus(4, "a100"), time_limit_s=86400,
                                                time_limit="24:00:00", default=True)
    found = probe("pbs", recorded(**PBS_PRO), user="alice", environ={},
                  which=lambda n: "/usr/bin/mpiexec.mpich" if n == "mpiexec.mpich" else None, host="login1")
    profile = _loads(profile_text(found), tmp_path)
    assert (profile.launcher, profile.queue, profile.devices_per_node, profile.device, profile.backend) == \
        ("mpich", "workq", 4, "cuda", "nccl")


def test_a_compute_node_of_amd_gpus_and_a_fast_network(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kfd").touch()
    for node, simds in enumerate((0, 440, 440)):  # topology node 0 is the CPU
        folder = tmp_path / "sys/class/kfd/kfd/topology/nodes" / str(node)
        folder.mkdir(parents=True)
        (folder / "properties").write_text(f"cpu_cores_count 64\nsimd_count {simds}\n")
    for name in ("eth0", "hsn0", "hsn1", "lo"):
        (tmp_path / "sys/class/net" / name).mkdir(parents=True)
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/route").write_text("Iface\tDestination\tGateway\neth0\t00000000\t0101A8C0\n")
    node = read_node(tmp_path)
    assert (node.nvidia_gpus, node.amd_gpus, node.default_route, node.fast_interface) == (0, 2, "eth0", "hsn0")
    sinfo = tmp_path / "sinfo.txt"
    sinfo.write_text("batch*|9408|56|512000|gpu:mi250x:8|2-00:00:00\n")
    text = profile_text(replace(probe("slurm", lambda argv: sinfo.read_text() if argv[0] == "sinfo" else None,
                                      user="alice", environ={}, which=no_program, host="login1"), node=node))
    profile = _loads(text, tmp_path)
    assert (profile.ranks_per_node, profile.devices_per_node, profile.device, profile.backend) == (8, 8, "cuda", "nccl")
    assert profile.env == {"GLOO_SOCKET_IFNAME": "hsn0", "NCCL_SOCKET_IFNAME": "hsn0"}
    assert "AMD (torch's ROCm build: cuda is HIP, nccl is RCCL)" in text


def test_launcher_flavours():
    slurm, pbs = registry.reader("slurm"), registry.reader("pbs")
    assert slurm.find_launcher(lambda a: None, lambda n: None).launcher is None
    assert pbs.find_launcher(lambda a: None, lambda n: f"/usr/bin/{n}").launcher == "mpich"
    plain = {"mpiexec": "/opt/cray/pals/1.2/bin/mpiexec"}
    assert pbs.find_launcher(lambda a: "", plain.get).launcher == "pals"
    openmpi = {"mpiexec": "/opt/openmpi-4.1/bin/mpiexec"}
    assert pbs.find_launcher(lambda a: "mpiexec (OpenRTE) 4.1.4", openmpi.get).launcher == "openmpi"


GPU_FACTS = ClusterFacts("slurm", "ddphpc", (
    Partition("debug", 2, 4, 1, None, None, "infinite", True),
    Partition("gpu", 2, 4, 1, Gpus(4, "a100"), 7200, "2:00:00")), ("root",))


def test_check_names_each_planted_mismatch_in_one_line():
    good = ClusterProfile(scheduler="slurm", launcher="srun", ranks_per_node=4, devices_per_node=4, device="cuda",
                          backend="nccl", cpus_per_task=1, queue="gpu", account="root",
                          match=ProfileMatch(cluster_name="ddphpc"))
    assert check_profile(good, GPU_FACTS, walltime_s=3600, which=shutil.which).mismatches == ()
    planted = replace(good, devices_per_node=8, ranks_per_node=8, account="nobody", launcher="srun")
    result = check_profile(planted, GPU_FACTS, walltime_s=3 * 3600, which=no_program)
    assert result.mismatches == (
        "devices_per_node: 8, but partition gpu's nodes declare 4 GPUs (gpu:a100:4)",
        "ranks_per_node x cpus_per_task: 8 x 1 = 8 CPUs, but partition gpu's nodes have 4",
        "walltime: 03:00:00 is over partition gpu's limit of 2:00:00",
        "account: 'nobody' is not one you may charge (sacctmgr lists: root)",
        "launcher: srun needs srun on PATH; none is here")
    missing = check_profile(replace(good, queue="a100", match=ProfileMatch(cluster_name="frontier")), GPU_FACTS,
                            walltime_s=60, which=shutil.which)
    assert missing.mismatches == ("match.cluster_name: 'frontier', but this cluster is 'ddphpc'",
                                  "queue: partition 'a100' does not exist (there are: debug, gpu)")
    xpu = check_profile(replace(good, device="xpu", backend="xccl"), GPU_FACTS, walltime_s=60, which=shutil.which)
    assert xpu.mismatches == ("device: xpu, but partition gpu's GPUs are a100 (NVIDIA: cuda)",)
    slurms_wrapper = {"mpiexec": "/usr/bin/mpiexec.slurm"}.get
    mpich = check_profile(replace(good, launcher="mpich"), GPU_FACTS, walltime_s=60, which=slurms_wrapper)
    assert mpich.mismatches == ("launcher: mpich, but the mpiexec on PATH is not: /usr/bin/mpiexec.slurm is "
                                "Slurm's mpiexec wrapper (mpiexec.slurm), not an MPI",)


def _profiles(folder: Path, **matches: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, match in matches.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(
            {"scheduler": "slurm", "launcher": "srun", "ranks_per_node": 1, "match": match}))


def test_the_profile_whose_match_fits_the_users_first(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_HPC_CLUSTERS_DIR", str(tmp_path / "mine"))
    monkeypatch.chdir(tmp_path)
    _profiles(tmp_path / "mine", mine={"cluster_name": "perlmutter"}, byhost={"hostname": "login*.frontier.*"})
    profile, why = find_profile(Machine(("perlmutter",), "login01", "slurm"), "slurm")
    assert profile.name == "mine" and why == "the scheduler's cluster name is 'perlmutter'"
    profile, why = find_profile(Machine((), "login03.frontier.olcf.ornl.gov", None), "slurm")
    assert profile.name == "byhost" and "fits 'login*.frontier.*'" in why
    with pytest.raises(ConfigError, match=r"no cluster profile for slurm matches this machine \(host 'laptop', "
                                          r"cluster name none answered\): run `ddp-hpc cluster probe"):
        find_profile(Machine((), "laptop"), "slurm")


def test_render_without_cluster_on_a_machine_with_no_match_is_one_line(tmp_path):
    # No scheduler's commands on PATH: nothing answers, no host pattern fits.
    env = {**os.environ, "PATH": str(Path(ddp_hpc_command()[0]).parent), "DDP_HPC_CLUSTERS_DIR": str(tmp_path)}
    result = subprocess.run([*ddp_hpc_command(), "render", "slurm", "--", "hostname"], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ddp-hpc: error: no cluster profile for slurm matches this machine (host "
        f"'{os.uname().nodename}', cluster name none answered): run `ddp-hpc cluster probe --out "
        "configs/clusters/NAME.yaml`, or give --cluster NAME"]


# ----- the real test cluster ------------------------------------------------------------------

@pytest.mark.slurm
def test_probe_render_submit_and_check_on_the_test_cluster(tmp_path, slurm_cluster):
    mine = tmp_path / "clusters"
    env = {**os.environ, "DDP_HPC_CLUSTERS_DIR": str(mine)}
    probed = run([*ddp_hpc_command(), "cluster", "probe", "--out", str(mine / "ddphpc-probed.yaml")], env=env)
    assert probed.returncode == 0, probed.stderr
    text = (mine / "ddphpc-probed.yaml").read_text()
    assert "#   gpu: 2 nodes, 4 CPUs, 1 MB, 4 x a100, time limit 2:00:00" in text, text
    assert "queue: debug" in text and "cluster_name: ddphpc" in text and f"account: {getpass.getuser()}" in text

    which = run([*ddp_hpc_command(), "cluster", "which", "--scheduler", "slurm"], env=env)
    assert which.stdout.splitlines()[0] == \
        f"ddphpc-probed ({mine / 'ddphpc-probed.yaml'}): the scheduler's cluster name is 'ddphpc'", which.stderr
    rendered = run([*ddp_hpc_command(), "render", "slurm", "--sbatch", "--nodes", "2", "--", "hostname"], env=env,
                   cwd=tmp_path)
    assert "for cluster profile 'ddphpc-probed'" in rendered.stdout, rendered.stderr
    assert "#SBATCH --partition=debug" in rendered.stdout and "#SBATCH --cpus-per-task=4" in rendered.stdout

    submitted = run([*ddp_hpc_command(), "submit", "slurm", "--sbatch", "--nodes", "2", "--walltime", "5", "--wait",
                     "--poll", "1", "--", sys_python(), "-c",
                     "import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())"],
                    env=env, cwd=tmp_path, timeout=240)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "rank 0 of 2" in submitted.stdout and "rank 1 of 2" in submitted.stdout

    assert run([*ddp_hpc_command(), "cluster", "check", "ddphpc-probed"], env=env).returncode == 0
    planted = yaml.safe_load(text) | {"queue": "gpu", "devices_per_node": 8, "ranks_per_node": 8, "device": "cuda",
                                      "backend": "nccl", "cpus_per_task": 1, "account": "nobody",
                                      "launcher": "openmpi"}
    (tmp_path / "planted.yaml").write_text(yaml.safe_dump(planted))
    checked = run([*ddp_hpc_command(), "cluster", "check", str(tmp_path / "planted.yaml"), "--walltime", "03:00:00"],
                  env=_scheduler_commands_only(env, tmp_path))
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert checked.stderr.splitlines() == [f"ddp-hpc: cluster check: planted: {line}" for line in (
        "devices_per_node: 8, but partition gpu's nodes declare 4 GPUs (gpu:a100:4)",
        "ranks_per_node x cpus_per_task: 8 x 1 = 8 CPUs, but partition gpu's nodes have 4",
        "walltime: 03:00:00 is over partition gpu's limit of 2:00:00",
        f"account: 'nobody' is not one you may charge (sacctmgr lists: {getpass.getuser()})",
        "launcher: openmpi needs mpiexec.openmpi or mpirun.openmpi or mpiexec on PATH; none is here")]


def sys_python() -> str:
    import sys
    return sys.executable


def _scheduler_commands_only(env: dict, tmp_path: Path) -> dict:
    """PATH with ddp-hpc and the scheduler's query commands, and no mpiexec."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("scontrol", "sinfo", "sacctmgr", "qstat", "pbsnodes"):
        (bin_dir / name).symlink_to(shutil.which(name))
    return {**env, "PATH": f"{Path(ddp_hpc_command()[0]).parent}{os.pathsep}{bin_dir}"}


@pytest.mark.slurm
def test_probe_through_slurms_pbs_wrappers(tmp_path, qsub):
    result = run([*ddp_hpc_command(), "cluster", "probe", "--scheduler", "pbs"])
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "scheduler: pbs" in text and "#   gpu: " in text and "#   debug: " in text
    assert "# note: server name and default queue: `qstat -B -f` did not answer (Slurm's PBS wrappers do not)" in text
    assert "# not learned: the default queue" in text
    checked = run([*ddp_hpc_command(), "cluster", "check", "pbs-generic"], env=_scheduler_commands_only({}, tmp_path))
    assert checked.returncode == 2 and checked.stderr.splitlines() == [
        "ddp-hpc: cluster check: pbs-generic: launcher: mpich needs mpiexec.mpich or mpiexec.hydra or mpiexec on PATH; "
        "none is here"], checked.stderr
    assert "note: queue debug: no walltime limit said (resources_max.walltime)" in checked.stdout


@pytest.mark.parametrize("name, devices, queue", [("perlmutter", 4, None), ("frontier", 8, "batch"),
                                                  ("lumi-g", 8, "standard-g"), ("leonardo", 4, "boost_usr_prod")])
def test_shipped_site_profiles_cite_their_guide_and_say_they_never_ran(name, devices, queue):
    text = (REPO / "ddp_hpc" / "clusters" / f"{name}.yaml").read_text()
    assert "Rendered here, never run" in text and "https://docs." in text
    profile = load_profile(name)
    assert (profile.scheduler, profile.launcher, profile.devices_per_node, profile.ranks_per_node, profile.device,
            profile.backend, profile.queue) == ("slurm", "srun", devices, devices, "cuda", "nccl", queue)
    assert profile.match is not None


@pytest.mark.slurm
@pytest.mark.mpi
def test_a_probed_pbs_profile_runs_a_two_node_job_through_the_wrappers(tmp_path, qsub, mpich):
    profile = tmp_path / "wrappers.yaml"
    probed = run([*ddp_hpc_command(), "cluster", "probe", "--scheduler", "pbs", "--out", str(profile)])
    assert probed.returncode == 0, probed.stderr
    assert "launcher: mpich  # mpiexec.mpich at " in profile.read_text()
    submitted = run([*ddp_hpc_command(), "submit", "pbs", "--cluster", str(profile), "--nodes", "2", "--walltime", "5",
                     "--wait", "--poll", "1", "--", sys_python(), "-c",
                     "import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())"],
                    cwd=tmp_path, timeout=240)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "rank 0 of 2" in submitted.stdout and "rank 1 of 2" in submitted.stdout


def test_which_for_local_needs_no_match(capsys):
    import argparse

    from ddp_hpc.schedulers.cluster.verbs import cmd_which

    assert cmd_which(argparse.Namespace(scheduler="local")) == 0
    out = capsys.readouterr().out
    assert out.startswith("local (") and out.endswith("): local always uses it\n")


def test_check_finds_the_profiles_mpi_among_several_installed_side_by_side():
    """Debian installs MPICH and Open MPI side by side (mpiexec.mpich, mpiexec.openmpi): a
    profile naming either fits; one whose MPI is not installed is named."""
    both = {"mpiexec.mpich": "/usr/bin/mpiexec.mpich", "mpiexec.openmpi": "/usr/bin/mpiexec.openmpi"}.get
    profile = ClusterProfile(scheduler="slurm", launcher="openmpi", ranks_per_node=1, queue="debug")
    for launcher in ("openmpi", "mpich"):
        assert check_profile(replace(profile, launcher=launcher), GPU_FACTS, walltime_s=60, which=both,
                             runner=lambda argv: None).mismatches == ()
    only_mpich = {"mpiexec.mpich": "/usr/bin/mpiexec.mpich", "mpiexec": "/usr/bin/mpiexec.mpich"}.get
    assert check_profile(profile, GPU_FACTS, walltime_s=60, which=only_mpich, runner=lambda argv: None).mismatches \
        == ("launcher: openmpi, but the mpiexec on PATH is not: mpiexec.mpich at /usr/bin/mpiexec.mpich",)


def test_where_slurm_and_its_pbs_wrappers_both_answer_slurm_is_the_scheduler():
    """Slurm's PBS wrappers answer ``qstat`` on a SLURM cluster: the probe and ``which`` take
    SLURM (its reader is asked first), and a PBS server alone is PBS."""
    from ddp_hpc.schedulers.cluster.probe import detect_scheduler
    from ddp_hpc.schedulers.cluster.which import this_machine

    both = recorded(**TEST_CLUSTER, **WRAPPERS)
    assert both(("scontrol", "show", "config")) and both(("qstat", "-Q", "-f")) is not None
    assert detect_scheduler(both) == "slurm"
    assert this_machine(both, hostname="login1").scheduler == "slurm"
    pbs_alone = recorded(**PBS_PRO)
    assert detect_scheduler(pbs_alone) == "pbs" and this_machine(pbs_alone, hostname="x").scheduler == "pbs"

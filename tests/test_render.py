"""Script rendering: what the scripts say, directive syntax, and injection safety."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.errors import UserError
from ddp_hpc.launch.restart import Decision
from ddp_hpc.specs.profiles import load_profile
from ddp_hpc.specs.request import CommandPayload, SubmitRequest, TrainPayload, parse_walltime
from ddp_hpc.schedulers import dry_run
from ddp_hpc.schedulers.pbs.render import render_pbs
from ddp_hpc.schedulers.slurm.render import render_sbatch

DIGITS = str(REPO / "configs" / "digits.yaml")


def request(cluster: str, nodes: int = 2, **kwargs) -> SubmitRequest:
    kwargs.setdefault("walltime", "00:30:00")
    payload = TrainPayload(kwargs.pop("config_path", DIGITS), tuple(kwargs.pop("overrides", ())))
    return SubmitRequest(payload=payload, profile=load_profile(cluster), nodes=nodes, **kwargs)


def launch_line(script: str) -> str:
    """What each rank runs: the command of ``exec ddp-hpc launch ... -- COMMAND``, the line
    every rendered script ends in."""
    [line] = [line.strip() for line in script.splitlines() if line.startswith("exec ddp-hpc ")]
    return line.partition(" -- ")[2]


#: The real ``ddp-hpc`` of this checkout (scripts run under a stub PATH).
REAL_DDP_HPC = str(Path(sys.executable).with_name("ddp-hpc"))


def pbs_launch(script: str, tmp_path: Path, hosts: str = "x1\nx2\n", job_id: str = "1.server", *,
               dry_run: bool = False):
    """The PBS script's ``exec ddp-hpc launch --hostfile ...`` line, parsed as the launch would
    (the script's variables from a stand-in job: the hosts, mpiexec, the run folder)."""
    from ddp_hpc import cli

    (tmp_path / "hosts").write_text(hosts)
    words = launch_line_of(script).replace("exec ddp-hpc launch ",
                                           f"printf '%s\\0' launch {'--dry-run ' if dry_run else ''}", 1)
    argv = subprocess.run(["bash", "-c", words], capture_output=True, text=True, check=True, env={
        "PATH": "/usr/bin:/bin", "DDP_HPC_HOSTFILE": str(tmp_path / "hosts"), "DDP_HPC_MPIEXEC": "/opt/pals/mpiexec",
        "DDP_HPC_RUN_FOLDER": str(tmp_path / "run"), "PBS_JOBID": job_id}).stdout.split("\0")[:-1]
    return cli.parse(argv)


def pbs_attempt(script: str, tmp_path: Path, capsys, hosts: str = "x1\nx2\n") -> str:
    """Each attempt's mpiexec, as the PBS script's launch line runs it (``--dry-run``, in
    this process)."""
    args = pbs_launch(script, tmp_path, hosts, dry_run=True)
    assert args.func(args) == 0
    return capsys.readouterr().out.splitlines()[-1]


def test_aurora_script(tmp_path, capsys):
    script = render_pbs(request("aurora", account="ABC"))
    assert "#PBS -l select=2\n" in script and "#PBS -A ABC\n" in script
    assert "#PBS -l walltime=00:30:00" in script and "#PBS -l filesystems=home:flare" in script
    launch = launch_line(script)
    attempt = pbs_attempt(script, tmp_path, capsys)
    assert '-n 24 -ppn 12' in attempt and f'--hostfile {tmp_path / "run" / ".hosts"} --envall' in attempt
    assert "--cpu-bind list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100" in attempt
    for preset in ("CCL_PROCESS_LAUNCHER=pmix", "CCL_ATL_TRANSPORT=mpi", "CCL_KVS_MODE=mpi",
                   "FI_MR_CACHE_MONITOR=userfaultfd", "ZE_FLAT_DEVICE_HIERARCHY=FLAT",
                   "DDP_HPC_DEVICE=xpu", "DDP_HPC_BACKEND=xccl"):
        assert f"export {preset}\n" in script
    assert 'first_host=$(head -n 1 "$DDP_HPC_HOSTFILE")' in script
    assert 'awk \'NF && !seen[$0]++\' "$PBS_NODEFILE"' in script
    assert 'export MASTER_ADDR="${first_host%%.*}".hsn.cm.aurora.alcf.anl.gov' in script
    assert 'export MASTER_PORT="$(ddp-hpc port)"' in script
    assert launch.endswith(f"ddp-hpc train {DIGITS}")


@pytest.mark.parametrize("cluster, passed_on", [("pbs-generic", "TERM"), ("aurora", "USR2")])
def test_a_pbs_script_passes_a_stop_to_mpiexec_as_the_signal_it_passes_on(cluster, passed_on, tmp_path, monkeypatch):
    """MPICH's Hydra ends the whole job on SIGUSR2 and passes SIGTERM on to the ranks (which
    stop on either); the PBS script's launch takes both (and the request's stop signal, here
    USR1) and sends mpiexec the one its flavour passes on. Inside the PBS job it records no
    job of its own: it writes the PBS job's exit file (``--job-id``)."""
    import signal

    from ddp_hpc import cli
    from ddp_hpc.launch import supervisor
    from ddp_hpc.stop import parse_stop_signal

    script = render_pbs(request(cluster, stop_signal=parse_stop_signal("USR1@60")))
    assert "trap '' USR2 TERM USR1\nexec ddp-hpc launch --launcher " in script
    args = pbs_launch(script, tmp_path, job_id="8[3].server")
    passed: list[int] = []

    class Signalled:  # the supervisor, as the launch's stop signals reach it; the ranks stop (75)
        def __init__(self, *args, **kwargs) -> None:
            pass

        def request_stop(self, signum: int) -> None:
            passed.append(signum)

        def run_to_decision(self) -> Decision:
            for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1):
                signal.raise_signal(signum)
            return Decision(restart=False, status=75, requeue=True)

    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM,
                                                             signal.SIGHUP)}
    monkeypatch.setattr(supervisor, "Supervisor", Signalled)
    try:
        for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):  # one the launch leaves alone says so
            signal.signal(signum, lambda signum, frame: passed.append(-signum))
        assert args.func(args) == 75
    finally:
        for signum, handler in kept.items():
            signal.signal(signum, handler)
    assert passed == [signal.Signals[f"SIG{passed_on}"]] * 3, passed
    run = tmp_path / "run"
    assert (run / "exit-8[3].server").read_text() == "75\n"  # the PBS job's, as the script keyed it
    assert not list(run.glob("submission*"))  # the qsub submission's record stays


def test_a_pbs_launch_moves_rank_0_s_address_with_the_profile_s_host_suffix(tmp_path, monkeypatch):
    """Aurora with a spare node: every attempt's ``MASTER_ADDR`` is its first host's short name
    with the profile's host suffix (the script's own line for the first), also after a
    restart left out the node where rank 0 failed; the attempt runs the mpiexec the script
    looked up, with the profile's CPU binding."""
    import shlex

    from ddp_hpc.launch import hosts, supervisor

    script = render_pbs(request("aurora", nodes=1, spare_nodes=1, max_restarts=1))
    assert 'export MASTER_ADDR="${first_host%%.*}".hsn.cm.aurora.alcf.anl.gov' in script
    args = pbs_launch(script, tmp_path, "x1.site\nx2.site\n")
    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(hosts, "start_all", lambda processes: started.extend(processes) or [])

    class TwoAttempts:  # rank 0 fails on x1 in the first attempt
        def __init__(self, start, *args, read_status, **kwargs) -> None:
            self.start, self.read_status = start, read_status

        def request_stop(self, signum: int) -> None:
            pass

        def run_to_decision(self) -> Decision:
            self.start(0)
            (tmp_path / "run" / "rank-failures-0").write_text("0 137\n")
            self.read_status(0, 137)
            self.start(1)
            return Decision(restart=False, status=0)

    monkeypatch.setattr(supervisor, "Supervisor", TwoAttempts)
    assert args.func(args) == 0
    assert [env["MASTER_ADDR"] for _, env in started] == ["x1.hsn.cm.aurora.alcf.anl.gov",
                                                         "x2.hsn.cm.aurora.alcf.anl.gov"]
    line = shlex.join(started[-1][0])
    assert line.startswith("/opt/pals/mpiexec -n 12 -ppn 12 --cpu-bind list:1-8:9-16:"), line


def test_polaris_script(tmp_path, capsys):
    script = render_pbs(request("polaris", nodes=3))
    launch = pbs_attempt(script, tmp_path, capsys, "x1\nx2\nx3\n")
    assert "#PBS -l select=3:system=polaris" in script
    assert "-n 12 -ppn 4 --depth 8 --cpu-bind depth" in launch
    assert "--envall" in launch
    assert "export DDP_HPC_BACKEND=nccl" in script and "export DDP_HPC_DEVICE=cuda" in script


def test_a_pbs_script_with_recover_runs_a_node_supervisor_per_node_under_the_launch(tmp_path, capsys):
    """``submit pbs --recover N``: the launch over the job's nodes recovers in place, each
    attempt's mpiexec one unbound node supervisor per node (its ranks would inherit a
    binding meant for one rank); refused with --stage-env."""
    script = render_pbs(request("polaris", nodes=3, recover=2))
    assert " --recover 2 --job-id " in launch_line_of(script)
    attempt = pbs_attempt(script, tmp_path, capsys, "x1\nx2\nx3\n")
    assert " -n 3 -ppn 1 " in attempt and "--depth" not in attempt and "--cpu-bind" not in attempt, attempt
    assert "--node-supervisor --nproc 4 --recover 2 " in attempt and attempt.endswith(f"-- ddp-hpc train {DIGITS}")
    with pytest.raises(UserError, match=r"^--recover with --stage-env"):
        render_pbs(request("polaris", recover=1, stage_env=True))


def test_a_pbs_launch_that_cannot_start_still_writes_the_job_s_exit_file(tmp_path):
    """The launch a PBS script becomes refuses a bad node file in one line, and the job's
    exit file says it failed (``--wait`` and ``status`` read it once qstat forgets the job)."""
    from ddp_hpc.cli import build_parser
    from ddp_hpc.contract import exit_file_name

    (tmp_path / "hosts").write_text("node_1\n")
    args = build_parser().parse_args(["launch", "--launcher", "mpich", "--hostfile", str(tmp_path / "hosts"),
                                      "--run-folder", str(tmp_path), "--job-id", "8.server", "--", "true"])
    with pytest.raises(UserError, match="is not a host name"):
        args.func(args)
    assert (tmp_path / exit_file_name("8.server")).read_text() == "1\n"


def test_the_recovery_store_is_on_loopback_only_where_every_node_supervisor_runs_here(monkeypatch, tmp_path):
    """``--hostfile --recover``: a node supervisor on another host (the only one listed, or a
    spare a restart may take) must reach the launch's store: loopback only when the one
    host is this machine."""
    import socket

    from ddp_hpc.launch.hosts import HostLaunch, recovery_store_host
    from ddp_hpc.launch.recovering import RecoveryLimits

    monkeypatch.setattr(socket, "gethostname", lambda: "here.site")

    def store(*listed: str) -> str:
        launch = HostLaunch("mpich", listed, 1, 2, ("true",), tmp_path, recovery=RecoveryLimits(1))
        return recovery_store_host(launch, {})

    assert store("here") == "127.0.0.1"
    assert store("far") != "127.0.0.1" and store("here", "spare") != "127.0.0.1"


def test_slurm_script_srun_per_rank(tmp_path):
    script = render_sbatch(request("slurm-gpu", account="proj", queue="a100"))
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --time=00:30:00", "#SBATCH --account=proj",
                 "#SBATCH --partition=a100", "#SBATCH --output=logs/%x-%j.out", "#SBATCH --signal=B:USR2@90",
                 "#SBATCH --requeue", "#SBATCH --job-name=digits"):
        assert line + "\n" in script
    # The attempts are ddp-hpc launch's (the one restart loop): it becomes the batch shell, so
    # Slurm's B:USR2 reaches it; it runs srun --kill-on-bad-exit=1 --wait=60 (tests/test_slurm_step.py).
    assert ("trap '' USR2\nexec ddp-hpc launch --launcher srun --nodes 2 --nproc 4 --max-restarts 0 "
            f'--run-folder "${{DDP_HPC_RUN_FOLDER}}" --stop-signal USR2 --requeue -- ddp-hpc train {DIGITS}\n') in script
    # Each attempt's step, as that line runs it: one task per rank, a failed task ends the step.
    assert dry_run_step(script, tmp_path) == ("srun --kill-on-bad-exit=1 --wait=60 --nodes=2 --ntasks=8 "
                                             f"--ntasks-per-node=4 ddp-hpc train {DIGITS}")


def test_a_slurm_script_with_recover_runs_node_supervisors_under_the_launch(tmp_path):
    """``submit slurm --sbatch --recover N``: the launch the script becomes recovers in place,
    each attempt's step one node supervisor per node; refused with --torchrun and
    --stage-env, whose ranks ddp-hpc launch does not start."""
    script = render_sbatch(request("slurm-gpu", recover=2, max_restarts=1))
    assert " --max-restarts 1 " in launch_line_of(script) and f" --recover 2 -- ddp-hpc train {DIGITS}" in script
    step = dry_run_step(script, tmp_path)
    assert step.startswith("srun --kill-on-bad-exit=1 --wait=60 --nodes=2 --ntasks=2 --ntasks-per-node=1 "), step
    assert "--node-supervisor --nproc 4 --recover 2 " in step and step.endswith(f"-- ddp-hpc train {DIGITS}"), step
    for refused in ({"torchrun_per_node": True}, {"stage_env": True}):
        with pytest.raises(UserError, match=r"^--recover needs one srun task per rank under ddp-hpc launch"):
            render_sbatch(request("slurm-gpu", recover=1, **refused))


def dry_run_step(script: str, tmp_path: Path, **env: str) -> str:
    """The srun step of each attempt, as the script's ``exec ddp-hpc launch ...`` line runs it
    (``--dry-run``, with the script's variables from ``env``)."""
    line = launch_line_of(script).replace("exec ddp-hpc launch ", f"exec {REAL_DDP_HPC} launch --dry-run ", 1)
    step = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_NUM_NODES": "2",
                               "SLURM_JOB_ID": "7", "DDP_HPC_RUN_FOLDER": str(tmp_path), **env})
    assert step.returncode == 0, step.stderr
    return step.stdout.strip()


def test_slurm_script_torchrun_per_node(tmp_path):
    script = render_sbatch(request("slurm-gpu", torchrun_per_node=True))
    assert "#SBATCH --ntasks-per-node=1\n" in script and "#SBATCH --cpus-per-task=32\n" in script
    assert 'rdzv_endpoint="$head_node:$(ddp-hpc port)"' in script
    assert '--torchrun "${rdzv_endpoint}" -- ddp-hpc train' in launch_line_of(script)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in script
    # With restarts, torchrun still never restarts (it would restart a stop, exit 75): the
    # launch does, and each attempt is a new torchrun with a fresh store.
    restarting = render_sbatch(request("slurm-gpu", torchrun_per_node=True, max_restarts=2))
    assert " --max-restarts 2 " in launch_line_of(restarting)
    assert dry_run_step(restarting, tmp_path, rdzv_endpoint="n1:29400") == (
        "srun --kill-on-bad-exit=1 --wait=60 --nodes=2 --ntasks=2 --ntasks-per-node=1 torchrun --nnodes 2 "
        "--nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint n1:29400 --rdzv-id 7 --max-restarts 0 --no-python "
        f"ddp-hpc train {DIGITS}")


def _profile_with(tmp_path: Path, shipped: str, launcher: str) -> str:
    """A copy of the shipped profile ``shipped`` whose launcher is ``launcher``."""
    import yaml

    data = yaml.safe_load((REPO / "ddp_hpc" / "clusters" / f"{shipped}.yaml").read_text())
    path = tmp_path / f"{shipped}-{launcher}.yaml"
    path.write_text(yaml.safe_dump({**data, "launcher": launcher, "match": None}))
    return str(path)


def test_a_profile_s_launcher_is_what_its_script_runs(tmp_path, caplog):
    """Issue 46: the launcher a profile names is the one its script starts, or one line says
    what runs instead. local: ``--launcher local`` (the old word ``torchrun`` loads as local);
    SLURM: ``torchrun`` is one torchrun per node as ``--torchrun`` renders it, ``mpich`` and
    ``openmpi`` run srun (said); PBS: the mpiexec the profile names."""
    from ddp_hpc.schedulers.local.backend import LocalScheduler

    local = LocalScheduler().dry_run(request("local", nodes=1), tmp_path).script
    assert "exec ddp-hpc launch --launcher local --nproc 2 " in local
    old_local = load_profile(_profile_with(tmp_path, "local", "torchrun"))
    assert old_local.launcher == "local" and "launcher: torchrun is now called local" in caplog.text
    torchrun_profile = _profile_with(tmp_path, "slurm-gpu", "torchrun")
    as_profile = render_sbatch(request(torchrun_profile))
    def without_comments(script: str) -> list[str]:  # the header names the profile
        return [line for line in script.splitlines() if not line.startswith("# ")]

    assert without_comments(as_profile) == without_comments(render_sbatch(request("slurm-gpu", torchrun_per_node=True)))
    assert '--torchrun "${rdzv_endpoint}" -- ddp-hpc train' in launch_line_of(as_profile)
    caplog.clear()
    mpich_profile = _profile_with(tmp_path, "slurm-gpu", "mpich")
    assert "exec ddp-hpc launch --launcher srun " in dry_run(request(mpich_profile), "sbatch", workdir=tmp_path).script
    assert "launcher: mpich is not how SLURM scripts start ranks: srun starts them" in caplog.text
    with pytest.raises(UserError, match="launcher 'srun' does not run under scheduler 'pbs'"):
        dry_run(request(_profile_with(tmp_path, "pbs-generic", "srun")), "pbs", workdir=tmp_path)
    with pytest.raises(UserError, match="launcher 'local' does not run under scheduler 'slurm'"):
        dry_run(request(_profile_with(tmp_path, "slurm-gpu", "local")), "sbatch", workdir=tmp_path)


@pytest.mark.parametrize("cluster,scheduler", [("aurora", "pbs"), ("polaris", "pbs"), ("pbs-generic", "pbs"),
                                               ("slurm-gpu", "slurm"), ("slurm-cpu", "slurm"), ("perlmutter", "slurm"),
                                               ("frontier", "slurm"), ("lumi-g", "slurm"), ("leonardo", "slurm")])
def test_rendered_scripts_are_valid_bash(cluster, scheduler):
    req = request(cluster, overrides=["training.epochs=2"], setup=("echo set up",), env={"A_B": "x y"})
    torchrun = dataclasses.replace(req, torchrun_per_node=True)
    for script in ([render_pbs(req)] if scheduler == "pbs" else [render_sbatch(req), render_sbatch(torchrun)]):
        result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert result.returncode == 0, result.stderr


# PBS Pro's qsub manual: the forms of the directives we write.
PBS_FORMS = {
    "-N": r"[A-Za-z][A-Za-z0-9_.+-]{0,235}",
    "-A": r"[A-Za-z0-9_.:=+,/@%-]+",
    "-q": r"[A-Za-z0-9_.:=+,/@%-]+",
    "-l": (r"select=\d+(:[a-z_]+=[A-Za-z0-9_.:=+,/@%-]+)*|walltime=\d{2,}:\d{2}:\d{2}|"
           r"filesystems=[A-Za-z0-9_]+(:[A-Za-z0-9_]+)*|place=(free|pack|scatter|vscatter)(:(excl|shared|exclhost))?"),
    "-j": r"oe|eo|n",
    "-k": r"[oed]+|n",
    "-r": r"y|n",
}


@pytest.mark.parametrize("cluster", ["aurora", "polaris", "pbs-generic"])
def test_pbs_directives_follow_the_qsub_manual(cluster):
    script = render_pbs(request(cluster, account="my.project-1", job_name="run_7"))
    directives = [line for line in script.splitlines() if line.startswith("#PBS")]
    assert directives
    for line in directives:
        _, option, value = line.split(" ", 2)
        assert re.fullmatch(PBS_FORMS[option], value), line
    # Directives are contiguous right after the shebang: qsub stops reading at the first command.
    assert script.splitlines()[1:1 + len(directives)] == directives


@pytest.mark.parametrize("text,expected", [("00:30:00", ("00:30:00", 30)), ("90", ("01:30:00", 90)),
                                           ("45:30", ("00:45:30", 46)), ("48:00:00", ("48:00:00", 2880))])
def test_walltime(text, expected):
    assert parse_walltime(text) == expected


@pytest.mark.parametrize("text", ["0", "1:61:00", "abc", "00:00:00", "-5"])
def test_bad_walltime(text):
    with pytest.raises(ConfigError, match="walltime"):
        parse_walltime(text)


def test_more_ranks_than_devices_is_refused():
    with pytest.raises(ConfigError, match="16 ranks per node but cluster 'aurora' has 12 xpu devices"):
        request("aurora", ranks_per_node=16)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown cluster profile 'auroa': choose one of .*aurora"):
        load_profile("auroa")


def test_profile_by_path_and_its_errors(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("scheduler: slurm\nlauncher: srun\nranks_per_node: 8\n")
    assert load_profile(str(good)).name == "mine"
    for text, fragment in [("scheduler: slurm\nlauncher: srun\nranks_per_node: 0\n", "ranks_per_node must be > 0"),
                           ("scheduler: slurm\nlauncher: srun\n", "ranks_per_node"),
                           ("scheduler: slurm\nlauncher: srun\nranks_per_node: 1\nenv: {'1X': a}\n",
                            "not a valid environment variable"),
                           ("scheduler: slurm\nlauncher: srun\nranks_per_node: 1\nqueue_name: x\n", "unknown key")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=fragment):
            load_profile(str(bad))
    # A launcher its scheduler does not run: the family's backend refuses it before rendering.
    bad.write_text("scheduler: pbs\nlauncher: srun\nranks_per_node: 1\n")
    srun_under_pbs = SubmitRequest(payload=CommandPayload(("true",)), profile=load_profile(str(bad)), nodes=1)
    with pytest.raises(UserError, match="cluster profile 'bad': launcher 'srun' does not run under scheduler 'pbs': "
                                        "use one of pals, mpich, openmpi"):
        dry_run(srun_under_pbs, workdir=tmp_path)


def test_a_bad_training_config_fails_at_render_time():
    with pytest.raises(ConfigError, match="training.batch_size must be > 0"):
        request("aurora", overrides=["training.batch_size=0"])


# ----- injection safety ---------------------------------------------------------------------

@pytest.mark.reliability
@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40))
def test_shell_quote_round_trips_on_one_line(value):
    from ddp_hpc.specs.request import shell_quote

    quoted = shell_quote(value)
    assert "\n" not in quoted and "\r" not in quoted
    out = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True).stdout
    assert out == value.encode("utf-8")


PAYLOADS = ["$(touch {canary})", "`touch {canary}`", "; touch {canary}", "\ntouch {canary}\n", "' ; touch {canary}; '",
            '" ; touch {canary}; "', "${{HOME}}", "$((6*7))", "&& touch {canary} #", "| tee {canary}", "\\", "*"]
noise = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\r/"), max_size=12)


def hostile(draw_text, payload, canary):
    return draw_text[0] + payload.format(canary=canary) + draw_text[1]


STUB = "#!/bin/sh\nprintf '%s\\0' \"$(basename \"$0\")\" \"$@\" >>\"$RECORD\"\n"
PORT_STUB = "#!/bin/sh\nif [ \"$1\" = port ]; then echo 29999; exit 0; fi\nprintf '%s\\0' ddp-hpc \"$@\" >>\"$RECORD\"\n"


@pytest.fixture(scope="module")
def stub_bin(tmp_path_factory) -> Path:
    """Stand-ins that record their argv: we test what reaches the launcher, not a launch."""
    folder = tmp_path_factory.mktemp("bin")
    for name in ("mpiexec", "mpiexec.mpich", "mpiexec.hydra", "srun", "scontrol"):
        (folder / name).write_text(STUB)
        (folder / name).chmod(0o755)
    (folder / "ddp-hpc").write_text(PORT_STUB)
    (folder / "ddp-hpc").chmod(0o755)
    return folder


def run_script(script: str, workdir: Path, stub_bin: Path, extra_env: dict[str, str]) -> list[str]:
    record = workdir / "record"
    record.unlink(missing_ok=True)
    env = {"PATH": f"{stub_bin}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(workdir), **extra_env}
    result = subprocess.run(["bash", "-c", script], env=env, cwd=workdir, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return record.read_bytes().decode().split("\0")[:-1] if record.exists() else []


@pytest.mark.reliability
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name_noise=st.tuples(noise, noise), override_noise=st.tuples(noise, noise),
       account_noise=st.tuples(noise, noise), payload=st.sampled_from(PAYLOADS), scheduler=st.sampled_from(["pbs", "slurm"]),
       as_command=st.booleans())
def test_hostile_strings_reach_the_ranks_verbatim_and_run_nothing(tmp_path, stub_bin, name_noise, override_noise,
                                                                  account_noise, payload, scheduler, as_command):
    canary = tmp_path / "CANARY"
    config_name = hostile(name_noise, payload.replace("/", ""), "CANARY").replace("\n", " ") or "c"
    config = tmp_path / f"{config_name[:80]}.yaml"
    config.write_text("job: {name: digits}\n")
    overrides = (f"job.params.note={hostile(override_noise, payload, canary)}",
                 f"logging.name={hostile(name_noise, payload, 'CANARY').replace('/', '_')}".rstrip("."))
    if overrides[1].endswith("=") or overrides[1].split("=", 1)[1] in (".", ".."):
        overrides = overrides[:1]
    command = ("python", hostile(override_noise, payload, canary), f"--note={hostile(name_noise, payload, canary)}")
    payload_value = CommandPayload(command, run_dir=str(tmp_path / "runs")) if as_command else TrainPayload(
        str(config), overrides)
    req = SubmitRequest(payload=payload_value,
                     profile=load_profile("pbs-generic" if scheduler == "pbs" else "slurm-cpu"), nodes=1,
                     account=hostile(account_noise, payload, canary), job_name=hostile(name_noise, payload, canary),
                     env={"USER_NOTE": hostile(override_noise, payload, canary)})
    script = render_pbs(req) if scheduler == "pbs" else render_sbatch(req)
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0
    for line in script.splitlines():
        if line.startswith(("#PBS", "#SBATCH")):
            assert re.fullmatch(r"#(PBS|SBATCH) [-A-Za-z0-9_.:=+,/@%% ]+", line), line
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\n")
    env = {"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path), "PBS_JOBID": "1.server",
           "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path)}
    argv = run_script(script, tmp_path, stub_bin, env)
    assert not canary.exists() and not (tmp_path / "CANARY").exists()
    expected_tail = ["ddp-hpc", "run", "--", *command] if as_command else ["ddp-hpc", "train", str(config), *overrides]
    assert argv[-len(expected_tail):] == expected_tail


def test_a_sweep_is_one_array_job_with_an_element_per_combination():
    from ddp_hpc.specs.sweep import Sweep

    sweep = Sweep.parse(["training.lr=0.001,0.003", "training.batch_size=32,64"], limit=2)
    req = request("slurm-cpu", nodes=1, sweep=sweep)
    assert [e.describe() for e in req.elements] == [
        "training.lr=0.001 training.batch_size=32", "training.lr=0.001 training.batch_size=64",
        "training.lr=0.003 training.batch_size=32", "training.lr=0.003 training.batch_size=64"]
    script = render_sbatch(req)
    assert "#SBATCH --array=0-3%2\n" in script and "#SBATCH --output=logs/%x-%A_%a.out\n" in script
    assert "  2) sweep_args=(training.lr=0.003 training.batch_size=32 logging.name=digits-2);" in script
    assert launch_line(script).endswith('ddp-hpc train ' + DIGITS + ' "${sweep_args[@]}"')
    pbs = render_pbs(request("pbs-generic", nodes=1, sweep=sweep))
    assert "#PBS -J 0-3%2\n" in pbs and 'case "${PBS_ARRAY_INDEX}" in' in pbs
    for text in (script, pbs):
        assert subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True).returncode == 0


def test_command_sweep_elements_get_their_index_and_values_as_variables(tmp_path, stub_bin):
    from ddp_hpc.specs.sweep import Sweep

    req = SubmitRequest(payload=CommandPayload(("sh", "-c", "true"), run_dir=str(tmp_path / "runs")),
                     profile=load_profile("slurm-cpu"), nodes=1, sweep=Sweep.parse(["lr=0.1,0.2"]))
    script = render_sbatch(req)
    assert "  1) sweep_args=(); export DDP_HPC_SWEEP_INDEX=1; export DDP_HPC_SWEEP_LR=0.2;" in script
    assert launch_line(script).endswith("ddp-hpc run -- sh -c true")


@pytest.mark.parametrize("specs,message", [
    (["training.lr"], "use KEY=V1,V2"),
    (["training.lr=0.1,,0.2"], "empty value"),
    (["training.lr=0.1", "training.lr=0.2"], "names a key twice"),
    (["training.lr=0.1"], "at least two elements"),
    (["training.lr=0.1,fast"], "element 1 (training.lr=fast): training.lr: expected float"),
    (["training.nope=1,2"], "element 0"),
])
def test_bad_sweeps_are_refused_before_anything_is_rendered(specs, message):
    from ddp_hpc.errors import UserError
    from ddp_hpc.specs.sweep import Sweep

    with pytest.raises(UserError, match=re.escape(message)):
        request("slurm-cpu", nodes=1, sweep=Sweep.parse(specs))


def test_a_chain_does_not_requeue_and_a_single_job_does():
    chained = render_sbatch(request("slurm-cpu", nodes=1, chain=3))
    single = render_sbatch(request("slurm-cpu", nodes=1))
    assert " --requeue -- " in launch_line_of(single) and " --requeue " not in launch_line_of(chained)


def launch_line_of(script: str) -> str:
    [line] = [line for line in script.splitlines() if line.startswith("exec ddp-hpc launch ")]
    return line


#: The stand-in ``ddp-hpc`` of the scripts run below, but ``ddp-hpc launch`` (where each script
#: ends) is the real one: it runs the recording launcher stubs; so is ``record-exit`` (a job
#: that ends before its launch).
LAUNCH_THROUGH = f'\ncase "$1" in launch|record-exit) exec {REAL_DDP_HPC} "$@";; esac\nprintf'

PREFLIGHT_STUB = ("#!/bin/sh\nprintf '%s\\0' \"$(basename \"$0\")\" \"$@\" >>\"$RECORD\"\n"
                  "case \"$*\" in *--links*) exit \"${PREFLIGHT_EXIT:-0}\";; esac\n")


@pytest.mark.parametrize("scheduler", ["pbs", "slurm"])
def test_preflight_checks_the_links_on_one_rank_per_node_and_a_failure_starts_no_rank(tmp_path, scheduler):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("mpiexec", "mpiexec.mpich", "mpiexec.hydra", "srun", "scontrol"):
        (folder / name).write_text(PREFLIGHT_STUB)
        (folder / name).chmod(0o755)
    # The launch is the real one (it runs the srun or mpiexec stub): the stub records the other calls.
    (folder / "ddp-hpc").write_text(PORT_STUB.replace("\nprintf", LAUNCH_THROUGH))
    (folder / "ddp-hpc").chmod(0o755)
    req = request("pbs-generic" if scheduler == "pbs" else "slurm-cpu", nodes=2, ranks_per_node=2, preflight=True,
                  overrides=[f"logging.run_dir={tmp_path / 'runs'}"])
    render = render_pbs if scheduler == "pbs" else render_sbatch
    script = render(req)
    assert "doctor --links" not in render(dataclasses.replace(req, preflight=False))
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("n1\nn2\n")
    env = {"PATH": f"{folder}:/usr/bin:/bin", "RECORD": str(tmp_path / "record"), "HOME": str(tmp_path),
           "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path), "PBS_JOBID": "1.server",
           "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NUM_NODES": "2"}

    def launches(preflight_exit: int) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
        (tmp_path / "record").unlink(missing_ok=True)
        result = subprocess.run(["bash", "-c", script], env={**env, "PREFLIGHT_EXIT": str(preflight_exit)},
                                cwd=tmp_path, capture_output=True, text=True, timeout=30)
        words = (tmp_path / "record").read_bytes().decode().split("\0")[:-1]
        calls, current = [], []
        for word in words:  # each launcher call starts with its program's name
            if word.startswith(("mpiexec", "srun")) and current:
                calls.append(current)
                current = []
            current.append(word)
        return result, [*calls, current] if current else calls

    result, calls = launches(0)
    assert result.returncode == 0, result.stderr
    first, second = calls
    assert first[-3:] == ["ddp-hpc", "doctor", "--links"]
    assert ("-ppn" in first and first[first.index("-ppn") + 1] == "1") if scheduler == "pbs" else \
        "--ntasks-per-node=1" in first and "--nodes=2" in first
    assert "train" in second

    result, calls = launches(1)
    assert result.returncode == 1
    assert len(calls) == 1 and calls[0][-1] == "--links"
    assert "pre-flight link check failed" in result.stderr
    exit_files = list((tmp_path / "runs").rglob("exit-*"))
    assert [f.read_text() for f in exit_files] == ["1\n"]


@pytest.mark.parametrize("step", ["pre-flight", "staging"])
def test_a_job_that_ends_before_its_launch_records_its_exit_through_the_one_writer(tmp_path, step):
    """A failed pre-flight or staging ends the job before ``ddp-hpc launch`` starts: its exit
    file is written by ``ddp-hpc record-exit`` (``restart.record_exit``), and by the script's
    own printf only where ddp-hpc cannot start."""
    from ddp_hpc.launch.script import preflight_lines, stage_lines

    lines = (preflight_lines("false", "${JOB}") if step == "pre-flight" else
             stage_lines(request("slurm-cpu", stage_env=True, stage_dir=str(tmp_path / "local")), "false", "JOB",
                         "${JOB}"))
    run, folder = tmp_path / "run", tmp_path / "bin"
    run.mkdir(), folder.mkdir()
    stub = folder / "ddp-hpc"  # records each call; record-exit is the real one
    stub.write_text(f'#!/bin/sh\necho "$*" >>"{tmp_path / "calls"}"\n'
                    f'[ "$1" = record-exit ] && exec {REAL_DDP_HPC} "$@"\nexit 0\n')
    stub.chmod(0o755)
    env = {"PATH": f"{folder}:/usr/bin:/bin", "DDP_HPC_RUN_FOLDER": str(run), "JOB": "8[3].server"}
    exit_file = run / "exit-8[3].server"
    for ddp_hpc_starts in (True, False):
        if not ddp_hpc_starts:
            stub.unlink()
            exit_file.unlink()
        result = subprocess.run(["bash", "-c", "\n".join(lines)], env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 1 and "the ranks were not started" in result.stderr, result.stderr
        assert exit_file.read_text() == "1\n"
    assert f"record-exit {run} 8[3].server 1" in (tmp_path / "calls").read_text().splitlines()


@pytest.mark.parametrize("scheduler", ["pbs", "slurm"])
def test_stage_env_fans_out_once_per_node_then_runs_the_ranks_from_the_copy(tmp_path, scheduler):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("mpiexec", "mpiexec.mpich", "mpiexec.hydra", "srun", "scontrol"):
        (folder / name).write_text(PREFLIGHT_STUB.replace("*--links*", "*fan-out*"))
        (folder / name).chmod(0o755)
    (folder / "ddp-hpc").write_text(PORT_STUB.replace("\nprintf", LAUNCH_THROUGH))  # the launch: the real one
    (folder / "ddp-hpc").chmod(0o755)
    req = request("pbs-generic" if scheduler == "pbs" else "slurm-cpu", nodes=2, ranks_per_node=2, stage_env=True,
                  stage_dir=str(tmp_path / "local"), overrides=[f"logging.run_dir={tmp_path / 'runs'}"])
    script = (render_pbs if scheduler == "pbs" else render_sbatch)(req)
    env = {"PATH": f"{folder}:/usr/bin:/bin", "RECORD": str(tmp_path / "record"), "HOME": str(tmp_path),
           "PBS_NODEFILE": str(tmp_path / "nodefile"), "PBS_O_WORKDIR": str(tmp_path), "PBS_JOBID": "1.server",
           "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NUM_NODES": "2"}
    (tmp_path / "nodefile").write_text("n1\nn2\n")

    def calls(fan_out_exit: int) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
        (tmp_path / "record").unlink(missing_ok=True)
        result = subprocess.run(["bash", "-c", script], env={**env, "PREFLIGHT_EXIT": str(fan_out_exit)},
                                cwd=tmp_path, capture_output=True, text=True, timeout=30)
        found, current = [], []
        for word in (tmp_path / "record").read_bytes().decode().split("\0")[:-1]:
            if word.startswith(("mpiexec", "srun")):  # the pack call comes first, alone
                found += [current] if current else []
                current = []
            current.append(word)
        return result, [*found, current]

    result, (pack, fan_out, ranks) = calls(0)
    assert result.returncode == 0, result.stderr
    assert pack == ["ddp-hpc", "stage", "pack"]
    assert fan_out[-6:-3] == ["ddp-hpc", "stage", "fan-out"] and fan_out[-2] == "--rendezvous"
    assert ("-ppn" in fan_out and fan_out[fan_out.index("-ppn") + 1] == "1") if scheduler == "pbs" else \
        "--ntasks-per-node=1" in fan_out and "--nodes=2" in fan_out
    # The rank's command, run as the launcher would on node n2: `ddp-hpc` is the node's copy's.
    # The staged wrapper (inside MPICH's rank wrapper, itself a bash -c now) runs the command.
    start = ranks.index("ddp-hpc-staged") - 3
    wrapped = ranks[start:]
    assert wrapped[:2] == ["bash", "-c"] and wrapped[3:5] == ["ddp-hpc-staged", "ddp-hpc"] and "train" in wrapped
    assert "ddp-hpc" not in ranks[:start]  # nothing from the shared environment runs first
    job_root = tmp_path / "local" / ("ddp_hpc-env-1.server" if scheduler == "pbs" else "ddp_hpc-env-7")
    (job_root / "n2" / "bin").mkdir(parents=True)
    (job_root / "n2" / "bin" / "ddp-hpc").write_text('#!/bin/sh\necho "copy of $VIRTUAL_ENV: $*"\n')
    (job_root / "n2" / "bin" / "ddp-hpc").chmod(0o755)
    ran = subprocess.run(wrapped, env={**env, "DDP_HPC_STAGE_ROOT": str(job_root), "SLURMD_NODENAME": "n2"},
                         capture_output=True, text=True, check=True)
    assert ran.stdout.startswith(f"copy of {job_root / 'n2'}: train ")
    assert f'export DDP_HPC_STAGE_ROOT={tmp_path / "local"}/ddp_hpc-env-"${{' in script

    result, found = calls(1)  # the fan-out fails: no rank starts, the job records exit 1
    assert result.returncode == 1 and "staging the environment failed" in result.stderr
    assert len(found) == 2 and "train" not in found[-1]
    assert [f.read_text() for f in (tmp_path / "runs").rglob("exit-*")] == ["1\n"]


def test_a_hostfile_launch_uses_the_spares_only_for_leaving_out_a_failed_host(tmp_path, monkeypatch):
    """``ddp-hpc launch --hostfile``: comments and repeats are dropped; with spare hosts and
    restarts the ranks run under the failure-recording wrapper and a restart's hostfile
    leaves out the host of the first rank that failed (recorded, rank 0's address moved);
    without spares neither is there."""
    import json
    import shlex

    from ddp_hpc.launch import hosts as hostfile_launch
    from ddp_hpc.launch.attempts import MarkedAttempts
    from ddp_hpc.launch.hosts import HostfileAttempts, HostLaunch, read_hostfile

    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\n# the spare:\nh2  # slow disk\nh1\n\n")
    hosts = read_hostfile(hostfile)
    assert hosts == ("h1", "h2")
    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(hostfile_launch, "start_all", lambda processes: started.extend(
        (list(argv), dict(env)) for argv, env in processes) or [])

    def attempt(steps: MarkedAttempts, number: int) -> tuple[str, dict[str, str], str]:
        """Attempt ``number``, as the launch starts it after the one before it failed."""
        if number > 0:
            steps.read_status(number - 1, 137)
        steps.start(number)
        argv, env = started[-1]
        return shlex.join(argv), env, steps.attempts.hostfile.read_text()

    run = tmp_path / "run"
    run.mkdir()
    spare = MarkedAttempts(HostfileAttempts(HostLaunch("mpich", hosts, 1, 2, ("sh", "-c", "exit 0"), run, 1),
                                            base_env={}), run)
    line, env, written = attempt(spare, 0)
    assert f"ddp-hpc-rank {sys.executable} -m ddp_hpc run -- sh -c 'exit 0'" in line  # the launch's interpreter
    assert f"-n 2 -ppn 2 -f {run / '.hosts'}" in line
    assert written == "h1\n" and env["MASTER_ADDR"] == "h1" and env["DDP_HPC_RESTART_COUNT"] == "0"
    (run / "rank-failures-0").write_text("1 137\n0 143\n")  # rank 1 failed first, on h1
    line, env, written = attempt(spare, 1)
    assert written == "h2\n" and env["MASTER_ADDR"] == "h2" and env["DDP_HPC_RESTART_COUNT"] == "1"
    assert [json.loads(entry) for entry in (run / "left-out-hosts.jsonl").read_text().splitlines()] == [
        {"host": "h1", "attempt": 0, "reason": "rank 1 exited with status 137"}]

    every = MarkedAttempts(HostfileAttempts(HostLaunch("openmpi", hosts, 2, 2, ("sh", "-c", "exit 0"),
                                                     tmp_path / "every", 1), base_env={}), tmp_path / "every")
    (tmp_path / "every").mkdir()
    line, env, written = attempt(every, 0)
    assert "ddp-hpc-rank" not in line and written == "h1\nh2\n"
    assert "-x MASTER_ADDR -x MASTER_PORT -x DDP_HPC_RESTART_COUNT" in line
    (tmp_path / "every" / "rank-failures-0").write_text("1 137\n")
    line, env, written = attempt(every, 1)
    assert written == "h1\nh2\n" and not (tmp_path / "every" / "left-out-hosts.jsonl").exists()


def test_ranks_under_mpich_run_in_the_wrapper_that_says_they_stopped(tmp_path):
    """Hydra reports the ranks' 75 as 0 about one time in six once it passed a stop on: under
    MPICH each rank of a launch with a run folder runs in the wrapper (which touches the
    preempted marker on 75), on this machine and over a hostfile, spares or not; Open MPI's
    ranks need none."""
    import shlex

    from ddp_hpc.launch.hosts import HostfileAttempts, HostLaunch
    from ddp_hpc.launch.entry import plan_launch
    from ddp_hpc.launch.spec import LaunchSpec

    wrapper = f"ddp-hpc-rank {sys.executable} -m ddp_hpc run"
    for flavour, wrapped in (("mpich", True), ("openmpi", False)):
        one = plan_launch(LaunchSpec(("sh", "-c", "exit 75"), launcher=flavour), tmp_path).attempts.attempts
        assert (wrapper in shlex.join(one.argv)) is wrapped
        assert one.base_env["DDP_HPC_RUN_FOLDER"] == str(tmp_path)
        hosts = HostfileAttempts(HostLaunch(flavour, ("h1",), 1, 2, ("sh", "-c", "exit 75"), tmp_path))
        assert (wrapper in shlex.join(hosts.argv())) is wrapped


# mpiexec -n N -ppn P -f HOSTFILE -genvall CMD...: the fan-out (one process per listed host)
# leaves a copy on each host it reaches, as `ddp-hpc stage fan-out` does; a rank launch runs
# every rank, as PBS's mpiexec would, with PMI_RANK and the host's name set.
SPARE_STUB = r'''#!/bin/sh
n=$2; ppn=$4; hosts=$6; shift 7
case "$*" in
  *fan-out*)
    head -n "$n" "$hosts" | while read -r host; do
      mkdir -p "$DDP_HPC_STAGE_ROOT/$host/bin"
      printf '#!/bin/sh\necho "rank $PMI_RANK attempt ${DDP_HPC_RESTART_COUNT:-0} from $VIRTUAL_ENV" >>"$RECORD"\n[ "$PMI_RANK.${DDP_HPC_RESTART_COUNT:-0}" != 0.0 ]\n' \
        >"$DDP_HPC_STAGE_ROOT/$host/bin/ddp-hpc"
      chmod +x "$DDP_HPC_STAGE_ROOT/$host/bin/ddp-hpc"
    done
    exit 0;;
esac
status=0
i=0
while [ "$i" -lt "$n" ]; do
  host=$(sed -n "$((i / ppn + 1))p" "$hosts")
  PMI_RANK=$i SLURMD_NODENAME=$host "$@" || status=1
  i=$((i + 1))
done
exit "$status"
'''


def test_stage_env_reaches_the_spare_node_a_pbs_restart_swaps_in(tmp_path):
    """--stage-env with --spare-nodes: rank 0 fails on n1, the restart runs on n2 and the spare
    n3, and the ranks on n3 run from n3's own copy, not from the shared environment."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("mpiexec", "mpiexec.mpich", "mpiexec.hydra"):
        (folder / name).write_text(SPARE_STUB)
        (folder / name).chmod(0o755)
    (folder / "ddp-hpc").write_text(PORT_STUB.replace("\nprintf", LAUNCH_THROUGH)  # the launch: the real one
                                    .replace('printf \'%s\\0\' ddp-hpc "$@"', 'echo "shared ddp-hpc $*"'))
    (folder / "ddp-hpc").chmod(0o755)
    req = request("pbs-generic", nodes=2, ranks_per_node=2, stage_env=True, spare_nodes=1, max_restarts=1,
                  stage_dir=str(tmp_path / "local"), overrides=[f"logging.run_dir={tmp_path / 'runs'}"])
    (tmp_path / "nodefile").write_text("n1\nn1\nn2\nn2\nn3\nn3\n")  # PBS Pro lists a host per rank slot
    env = {"PATH": f"{folder}:/usr/bin:/bin", "RECORD": str(tmp_path / "record"), "HOME": str(tmp_path),
           "PBS_NODEFILE": str(tmp_path / "nodefile"), "PBS_O_WORKDIR": str(tmp_path), "PBS_JOBID": "1.server",
           "PBS_JOBNAME": "digits"}
    result = subprocess.run(["bash", "-c", render_pbs(req)], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    root = tmp_path / "local" / "ddp_hpc-env-1.server"
    assert (tmp_path / "record").read_text().splitlines() == [
        "shared ddp-hpc stage pack",
        *(f"rank {r} attempt 0 from {root / ('n1' if r < 2 else 'n2')}" for r in range(4)),
        *(f"rank {r} attempt 1 from {root / ('n2' if r < 2 else 'n3')}" for r in range(4))]


# srun as in a job that Slurm signals while it runs: USR2 to the batch shell (as --signal=B:
# does; the shell is the launch by then, which passes it on to srun, which survives it), then the ranks' exit status;
# scontrol records that it was asked to requeue.
SIGNALLED_SRUN = "#!/bin/sh\ntrap : USR2\nkill -USR2 \"$PPID\"\nsleep 0.3\nexit \"$SRUN_EXIT\"\n"
RECORDING_SCONTROL = "#!/bin/sh\nprintf '%s\\n' \"$*\" >>\"$RECORD\"\n"


@pytest.mark.parametrize("ranks_exit,requeued", [(0, False), (75, True), (1, True), (143, True)])
def test_a_stop_signal_requeues_the_job_unless_the_ranks_had_finished(tmp_path, ranks_exit, requeued):
    """Slurm may send its stop signal up to a minute early: when it comes while a finished
    run tears down (the ranks exit 0), the script must not start the job again."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("srun", SIGNALLED_SRUN), ("scontrol", RECORDING_SCONTROL), ("squeue", "#!/bin/sh\n")):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    (folder / "ddp-hpc").symlink_to(REAL_DDP_HPC)  # the launch that owns the step is the real one
    script = render_sbatch(request("slurm-cpu", nodes=1, overrides=[f"logging.run_dir={tmp_path / 'runs'}"]))
    env = {"PATH": f"{folder}:/usr/bin:/bin", "RECORD": str(tmp_path / "record"), "HOME": str(tmp_path),
           "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path), "SRUN_EXIT": str(ranks_exit),
           "SLURM_JOB_NUM_NODES": "1"}
    result = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert "stop signal (time limit or preemption)" in result.stderr, result.stderr
    assert result.returncode == ranks_exit, result.stderr
    record = tmp_path / "record"
    assert (record.exists() and record.read_text() == "requeue 7\n") is requeued, result.stderr
    assert ("requeueing job 7" in result.stderr) is requeued


@pytest.mark.parametrize("rank_exit", [0, 75, 3, 137])
def test_the_rank_wrapper_passes_a_stop_signal_on_and_reports_the_rank_s_own_status(tmp_path, rank_exit):
    """Under mpiexec every rank runs in a small sh wrapper that passes USR2 on; the signal
    must not turn a rank's own exit (0, 75) into a failure (140) of that rank."""
    from ddp_hpc.contract import RANK_FAILURES_PREFIX
    from ddp_hpc.launch.script import recording_rank_failures

    rank = ["sh", "-c", f"trap 'echo got USR2' USR2; sleep 0.5; kill -USR2 $PPID; sleep 0.3; exit {rank_exit}"]
    result = subprocess.run(recording_rank_failures(rank), capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "DDP_HPC_RUN_FOLDER": str(tmp_path), "PMI_RANK": "1"})
    assert "got USR2" in result.stdout and result.returncode == rank_exit, result
    failures = list(tmp_path.glob(f"{RANK_FAILURES_PREFIX}*"))
    assert [p.read_text() for p in failures] == ([f"1 {rank_exit}\n"] if rank_exit not in (0, 75) else [])
    assert not (tmp_path / "preempted").exists()  # rank 1's: only rank 0 says the ranks stopped


def test_the_rank_wrapper_leaves_the_preempted_marker_through_its_one_writer(tmp_path):
    """Rank 0's 75 under mpiexec: the wrapper calls ``ddp-hpc record-stop`` (the marker's one
    writer, StopAgreement's), seen here through a ``ddp-hpc`` on PATH that notes its arguments
    and runs the real one; and ``record-stop`` itself leaves the marker."""
    from conftest import ddp_hpc_command
    from ddp_hpc.launch.script import recording_rank_failures

    calls, folder = tmp_path / "calls", tmp_path / "run"
    shim = tmp_path / "bin" / "ddp-hpc"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\necho "$@" >>{calls}\nexec {" ".join(ddp_hpc_command())} "$@"\n')
    shim.chmod(0o755)
    result = subprocess.run(recording_rank_failures(["sh", "-c", "exit 75"]), timeout=60, env={
        "PATH": f"{shim.parent}:/usr/bin:/bin", "DDP_HPC_RUN_FOLDER": str(folder), "PMI_RANK": "0"})
    assert result.returncode == 75 and calls.read_text() == f"record-stop {folder}\n"
    assert (folder / "preempted").exists()
    elsewhere = tmp_path / "other"
    assert subprocess.run([*ddp_hpc_command(), "record-stop", str(elsewhere)], timeout=60).returncode == 0
    assert [p.name for p in elsewhere.iterdir()] == ["preempted"]
    from ddp_hpc import cli

    assert "record-stop" not in cli.build_parser().format_help()  # internal, like record-exit


def test_the_rank_wrapper_says_rank_0_stopped_and_hands_the_rank_stdin_and_an_interrupt(tmp_path):
    """Rank 0's 75 touches the preempted marker (Hydra may report it as 0), another rank's
    does not; the rank, a background job of the shell (SIGINT ignored, stdin /dev/null), still
    reads the wrapper's stdin, and a SIGINT to the wrapper reaches it as SIGTERM."""
    import signal
    import time

    from ddp_hpc.launch.script import recording_rank_failures

    env = {"PATH": "/usr/bin:/bin", "DDP_HPC_RUN_FOLDER": str(tmp_path)}
    for rank in ("1", "0"):
        result = subprocess.run(recording_rank_failures(["sh", "-c", "exit 75"]), env={**env, "PMI_RANK": rank},
                                timeout=30)
        assert result.returncode == 75 and (tmp_path / "preempted").exists() == (rank == "0")
    result = subprocess.run(recording_rank_failures(["cat"]), input="to rank 0\n", capture_output=True, text=True,
                            env=env, timeout=30)
    assert result.stdout == "to rank 0\n", result
    rank = "trap 'exit 75' TERM; touch ready; while :; do sleep 0.05; done"
    # SIGINT at its default in the wrapper: a shell started with it ignored (pytest run as a
    # background job, which a non-interactive shell starts with SIGINT ignored) cannot trap it.
    process = subprocess.Popen(recording_rank_failures(["sh", "-c", rank]), cwd=tmp_path, env=env,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 75
    finally:
        end_group(process)


def end_group(process: subprocess.Popen) -> None:
    """End a process started in a session of its own, and all it started (passed or not)."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def test_the_rank_wrapper_passes_on_a_signal_that_comes_as_the_rank_starts(tmp_path):
    """The wrapper's traps are set before it starts the rank: a SIGTERM that reaches it right
    after the fork (before ``child=$!``; here made certain by a bash DEBUG trap) is passed on
    to the rank, and the wrapper exits with the rank's status, no rank left running. Without
    the traps there the wrapper dies of it and the rank runs on."""
    from ddp_hpc.launch.script import recording_rank_failures

    (tmp_path / "env.sh").write_text('trap \'[ "$BASH_COMMAND" = "child=\\$!" ] && kill -TERM $$\' DEBUG\n')
    rank = "echo $$ >rank.pid; trap 'exit 75' TERM; while :; do sleep 0.05; done"
    argv = recording_rank_failures(["sh", "-c", rank])  # bash, which reads $BASH_ENV
    process = subprocess.Popen(argv, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "BASH_ENV": str(tmp_path / "env.sh")},
                               start_new_session=True)
    try:
        # The rank's status, 75 or (the TERM came before its own trap) 143; not the wrapper's -15.
        assert process.wait(timeout=20) in (75, 143)
        pid_file = tmp_path / "rank.pid"  # absent where the TERM came before the rank's first line
        assert not pid_file.exists() or not _alive(int(pid_file.read_text()))
    finally:
        end_group(process)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_rank_wrapper_reports_a_rank_killed_by_a_signal_and_exits(tmp_path):
    """A rank killed by SIGKILL (no stop signal at all) ends with 137: the wrapper records it
    and exits with it at once, so that mpiexec sees the failure."""
    from ddp_hpc.contract import RANK_FAILURES_PREFIX
    from ddp_hpc.launch.script import recording_rank_failures

    result = subprocess.run(recording_rank_failures(["sh", "-c", "kill -KILL $$"]), capture_output=True,
                            text=True, timeout=10,
                            env={"PATH": "/usr/bin:/bin", "DDP_HPC_RUN_FOLDER": str(tmp_path), "PMI_RANK": "1"})
    assert result.returncode == 137, result
    assert [p.read_text() for p in tmp_path.glob(f"{RANK_FAILURES_PREFIX}*")] == ["1 137\n"]

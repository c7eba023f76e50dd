"""The CLI as a user meets it: exit codes and one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, ddp_hpc_command, run


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_env_json_for_one_process():
    result = run([*ddp_hpc_command(), "env", "--json"])
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["source"], record["rank"], record["world_size"]) == ("single", 0, 1)
    assert (record["device"], record["backend"]) == ("cpu", "gloo")


@pytest.mark.parametrize("args,fragment", [
    (["env", "--device", "cpu", "--backend", "nccl"], "backend 'nccl' cannot communicate cpu tensors"),
    (["env", "--device", "xpu"], "device 'xpu' was requested"),
    (["env", "--device", "gpu"], "unknown device 'gpu'"),
    (["env", "--bogus"], "unrecognized arguments: --bogus"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["launch", "--nproc", "0", "--", "true"], "--nproc 0 must be >= 1"),
    (["launch", "--nproc", "2"], "no command to launch"),
    (["launch", "--nproc", "x"], "invalid int value: 'x'"),
])
def test_bad_input_gives_one_line_and_exit_2(forked_cli, args, fragment):
    result = forked_cli.run(args, clean_env(), REPO)
    assert result.returncode == 2
    assert fragment in _one_error_line(result)


def test_environment_variables_choose_the_backend():
    # nccl cannot carry CPU tensors on any host, with or without GPUs.
    result = run([*ddp_hpc_command(), "env"], env={"DDP_HPC_BACKEND": "nccl", "DDP_HPC_DEVICE": "cpu"})
    assert result.returncode == 2
    assert "backend 'nccl' cannot communicate cpu tensors" in _one_error_line(result)


def test_conflicting_launcher_variables_exit_2():
    result = run([*ddp_hpc_command(), "env"], env={"RANK": "1", "WORLD_SIZE": "2", "PMI_RANK": "0",
                                                   "PMI_SIZE": "2", "MPI_LOCALRANKID": "0",
                                                   "MPI_LOCALNRANKS": "2"})
    assert result.returncode == 2
    assert "launcher variables disagree" in _one_error_line(result)


def test_debug_shows_the_traceback():
    result = run([*ddp_hpc_command(), "env", "--debug", "--device", "cpu", "--backend", "nccl"])
    assert result.returncode == 2
    assert "Traceback" in result.stderr


def test_launch_dry_run_prints_the_command():
    result = run([*ddp_hpc_command(), "launch", "--nproc", "3", "--dry-run", "--", "ddp-hpc", "doctor"])
    assert result.returncode == 0
    assert "# 3 ranks, each with torchrun's worker variables" in result.stdout
    assert result.stdout.splitlines()[-1] == "ddp-hpc doctor"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in result.stdout


def test_the_launcher_once_called_torchrun_is_local_and_its_old_name_still_works():
    """``--launcher torchrun`` started no torchrun: its name is ``local`` now; the old one
    starts the same ranks, with one line that says so."""
    plain = run([*ddp_hpc_command(), "launch", "--nproc", "2", "--dry-run", "--", "ddp-hpc", "doctor"])
    named = run([*ddp_hpc_command(), "launch", "--launcher", "local", "--nproc", "2", "--dry-run", "--",
                 "ddp-hpc", "doctor"])
    old = run([*ddp_hpc_command(), "launch", "--launcher", "torchrun", "--nproc", "2", "--dry-run", "--",
               "ddp-hpc", "doctor"])
    assert plain.returncode == named.returncode == old.returncode == 0, old.stderr
    assert plain.stdout == named.stdout == old.stdout
    assert "--launcher torchrun is now called --launcher local" in old.stderr
    assert "torchrun" not in plain.stderr + named.stderr


def test_launch_with_restarts_gives_each_attempt_a_fresh_store():
    """A script's own init_process_group must not read the previous attempt's addresses (under
    torchrun's agent it did: tests/test_own_loop.py): each attempt's rank 0 serves a new store."""
    result = run([*ddp_hpc_command(), "launch", "--nproc", "2", "--max-restarts", "1", "--dry-run", "--",
                  "python", "train.py"])
    assert result.returncode == 0, result.stderr
    assert "at most 1 restart(s) after a failure, none after a stop (75)" in result.stdout
    assert "rank 0 serves a fresh store on a free port each attempt" in result.stdout
    assert result.stdout.splitlines()[-1].endswith(" -m ddp_hpc run -- python train.py")



def test_a_refused_launch_over_a_hostfile_still_ends_the_pbs_job_it_runs_in(tmp_path, capsys):
    """A PBS script's launch (``--job-id``) that refuses its arguments exits 2 in one line and
    writes the job's exit file as failed: ``--wait`` and ``status`` see the job end."""
    from ddp_hpc import cli

    (tmp_path / "hosts").write_text("h1\nh2\n")
    (tmp_path / "run").mkdir()  # the script's (mkdir -p "$DDP_HPC_RUN_FOLDER")
    args = cli.parse(["launch", "--launcher", "mpich", "--hostfile", str(tmp_path / "hosts"), "--nodes", "3",
                      "--run-folder", str(tmp_path / "run"), "--job-id", "8.server", "--", "true"])
    assert cli._run(args) == 2
    assert capsys.readouterr().err == "ddp-hpc: error: --nodes 3: the hostfile lists 2 host(s)\n"
    assert (tmp_path / "run" / "exit-8.server").read_text() == "1\n"

@pytest.mark.parametrize("launcher,recover", [("local", []), ("mpich", []), ("mpich", ["--recover", "1"])],
                         ids=["local", "mpich", "mpich-recover"])
def test_a_launch_found_by_its_path_runs_without_its_environment_on_path(launcher, recover, tmp_path, request):
    """``/venv/bin/ddp-hpc launch`` with only /usr/bin and /bin on PATH (a cron job, a batch
    script): what the launch starts of its own (``ddp-hpc run`` around each rank; under
    ``--recover`` and mpiexec, the node supervisor around them) is its own interpreter's, not a
    name looked up on PATH."""
    if launcher != "local":
        request.getfixturevalue(launcher)
    script = tmp_path / "x.py"
    # One write per rank (print's pieces are separate writes unbuffered: two ranks' lines interleaved once in CI).
    script.write_text("import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\")\n")
    launch = [str(Path(sys.executable).parent / "ddp-hpc"), "launch", "--nproc", "2", "--launcher", launcher, *recover]
    result = run([*launch, "--", sys.executable, str(script)], env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("rank ")) == [
        "rank 0 of 2", "rank 1 of 2"], result.stdout


def test_doctor_single_process():
    result = run([*ddp_hpc_command(), "doctor"])
    assert result.returncode == 0, result.stderr
    assert "doctor: OK: 1 ranks on 1 node(s)" in result.stdout


@pytest.mark.parametrize("args,fragment", [
    (["train", "configs/nope.yaml"], "cannot read config configs/nope.yaml"),
    (["train", "configs/digits.yaml", "training.batch_size=-1"], "training.batch_size must be > 0, got -1"),
    (["train", "configs/digits.yaml", "training.grad_accum_steps=0"], "training.grad_accum_steps must be > 0"),
    (["train", "configs/digits.yaml", "training.bach_size=4"], "unknown key 'training.bach_size'"),
    (["train", "configs/digits.yaml", "job.name=missing_module:Job"], "cannot import module 'missing_module'"),
    (["train", "configs/digits.yaml", "distributed.backend=nccl", "distributed.device=cpu"],
     "backend 'nccl' cannot communicate cpu tensors"),
    (["train", "configs/digits.yaml", "training.epochs"], "is not KEY=VALUE"),
    (["train", "configs/digits.yaml", "checkpoint.resume=/nonexistent.pt"], "checkpoint /nonexistent.pt does not exist"),
])
def test_bad_training_input_exits_2_and_writes_nothing(tmp_path, forked_cli, args, fragment):
    result = forked_cli.run([*args, f"logging.run_dir={tmp_path}"], clean_env(), REPO)
    assert result.returncode == 2, result.stderr
    assert fragment in _one_error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_train_single_process_prints_the_run_folder(tmp_path):
    result = run([*ddp_hpc_command(), "train", "configs/digits.yaml", "training.epochs=2",
                  f"logging.run_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    assert f"run folder: {tmp_path}/digits" in result.stdout
    assert {p.name for p in (tmp_path / "digits").iterdir()} == {
        "checkpoints", "config.yaml", "metrics.jsonl", "summary.json", "record", "curves.png", "logs"}


def test_scheduler_commands_and_a_config_that_does_not_load_never_import_torch(tmp_path):
    """Login nodes: render, submit --dry-run and status answer without torch (its import
    costs seconds there), and so does train with a config that does not load. A torch that
    cannot be imported shadows the real one."""
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = {"PYTHONPATH": str(tmp_path / "poison")}
    digits = str(REPO / "configs" / "digits.yaml")
    for args in (["render", "slurm", digits, "--cluster", "slurm-cpu"],
                 ["render", "pbs", digits, "--cluster", "aurora"],
                 ["submit", "slurm", "--cluster", "slurm-cpu", "--sbatch", "--dry-run", digits],
                 ["submit", "pbs", "--cluster", "pbs-generic", "--dry-run", "--", "python", "train.py"]):
        result = run([*ddp_hpc_command(), *args], env=env, cwd=tmp_path)
        assert result.returncode == 0 and "#!/bin/bash" in result.stdout, (args, result.stderr[-2000:])
    status = run([*ddp_hpc_command(), "status", str(tmp_path / "no-run")], env=env, cwd=tmp_path)
    assert status.returncode == 2 and "neither a run folder nor a job id" in status.stderr, status.stderr
    bad = run([*ddp_hpc_command(), "train", digits, "training.epochs=ten"], env=env, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr == "ddp-hpc: error: training.epochs: expected int, got 'ten'\n", \
        bad.stderr[-2000:]
    # The poison works: what needs torch says so.
    assert "torch was imported" in run([*ddp_hpc_command(), "env"], env=env, cwd=tmp_path).stderr


def test_submitting_a_config_with_trackers_needs_no_tracker_package(tmp_path):
    """A login node submits a config naming mlflow without mlflow installed: loading the
    config checks no tracker package (train() does, where the trackers start)."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    # As if mlflow were not installed: its import fails and find_spec finds nothing.
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    env = {"PYTHONPATH": str(hidden)}
    digits = str(REPO / "configs" / "digits.yaml")
    result = run([*ddp_hpc_command(), "submit", "pbs", "--cluster", "pbs-generic", "--dry-run", digits,
                  "logging.trackers=[mlflow]"], env=env, cwd=tmp_path)
    assert result.returncode == 0 and "#!/bin/bash" in result.stdout, result.stderr[-2000:]
    assert "logging.trackers=[mlflow]" in result.stdout
    probe = run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('mlflow'))"],
                env=env, cwd=tmp_path)
    assert probe.stdout.strip() == "None", probe.stderr


def test_a_new_family_is_one_scheduler_class_and_one_family_object(monkeypatch, capsys, tmp_path):
    """docs/architecture.md, "Adding a scheduler family": with its Scheduler subclass and its
    SchedulerFamily among the registry's families (an entry point in a site's package, here put
    there directly; tests/test_site_scheduler.py goes through entry points), render and submit
    offer the family (and its profiles load), with the options its backend declares, whose
    values reach the request field they name."""
    from ddp_hpc import cli
    from ddp_hpc.schedulers import registry
    from ddp_hpc.schedulers.base import DryRun, RunOpt, Scheduler, SchedulerFamily

    class ToyScheduler(Scheduler):
        name = family = "toy"
        script_suffix = ".sh"
        launchers = ("torchrun",)
        run_opts = (RunOpt(("--toy-torchrun",), "the toy backend's own option", "backend",
                           {"action": "store_true"}, request_field="torchrun_per_node"),)

        def dry_run(self, request, workdir, script_path=None):
            self.check_profile(request)
            return DryRun(self.name, request, workdir, tuple(request.rank_command()),
                          script=f"#!/bin/sh\n# toy script for {request.world_size} ranks, "
                                 f"torchrun {request.torchrun_per_node}\n",
                          submit_argv=("toy-submit", "job.sh"))

        def submit(self, dry_run):
            raise AssertionError("--dry-run submits nothing")

        def job_status(self, job_id, exit_file):
            raise AssertionError("not asked")

        def cancel_jobs(self, job_ids):
            raise AssertionError("not asked")

    profile = tmp_path / "toy-cluster.yaml"
    profile.write_text("scheduler: toy\nlauncher: torchrun\nranks_per_node: 2\n")
    monkeypatch.setitem(registry.scheduler_families(), "toy", SchedulerFamily("toy", (ToyScheduler,), str(profile)))
    with pytest.raises(SystemExit):
        cli.parse(["submit", "toy", "--help"])
    assert "--toy-torchrun" in capsys.readouterr().out
    args = cli.parse(["submit", "toy", "--dry-run", "--toy-torchrun", "--ranks-per-node", "2",
                      "--run-dir", str(tmp_path), "--", "true"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/sh\n# toy script for 2 ranks, torchrun True\n"), out
    assert "# per-rank command (2 ranks): ddp-hpc run -- true" in out and "# would run: toy-submit job.sh" in out
    args = cli.parse(["render", "toy", "--run-dir", str(tmp_path), "--", "true"])
    assert args.func(args) == 0 and capsys.readouterr().out == "#!/bin/sh\n# toy script for 2 ranks, torchrun False\n"


@pytest.mark.parametrize("how", ["sigterm", "cancel"])
def test_a_sigterm_to_a_hostfile_launch_ends_its_ranks(mpich, tmp_path, how):
    """A SIGTERM to ``ddp-hpc launch --hostfile`` itself (a timeout wrapper, a closed
    terminal), or ``ddp-hpc cancel RUN`` (the launch is recorded there as a local job, its
    pid the job id, in its caller's process group), ends the ranks too."""
    import signal
    import socket
    import subprocess
    import time

    from conftest import clean_env

    (tmp_path / "hosts").write_text(socket.gethostname() + "\n")
    marker = f"sleep {4000 + tmp_path.stat().st_ino % 1000}"  # a command line no other test runs
    argv = [*ddp_hpc_command(), "launch", "--launcher", "mpich", "--hostfile", str(tmp_path / "hosts"),
            "--nproc", "2", "--run-folder", str(tmp_path / "run"), "--", *marker.split()]
    process = subprocess.Popen(argv, env=clean_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)

    def ranks() -> int:
        found = subprocess.run(["pgrep", "-fx", marker], capture_output=True, text=True)
        return len(found.stdout.split())

    deadline = time.monotonic() + 60
    while ranks() < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ranks() == 2, "the ranks never started"
    if how == "sigterm":
        process.send_signal(signal.SIGTERM)
    else:
        cancel = subprocess.run([*ddp_hpc_command(), "cancel", str(tmp_path / "run")], env=clean_env(),
                                capture_output=True, text=True, timeout=60)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    process.communicate(timeout=60)
    deadline = time.monotonic() + 20
    while ranks() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ranks() == 0, "the ranks outlived the launch"


@pytest.mark.parametrize("launcher", ["mpich", "openmpi", "hostfile"])
def test_a_stop_signal_to_the_launch_reaches_the_ranks_through_mpiexec(launcher, tmp_path, request):
    """SIGUSR2 to ``ddp-hpc launch`` under mpiexec is a stop: the ranks get a signal they
    stop on, through mpiexec (Hydra dies of SIGUSR2 and passes SIGTERM on; Open MPI's mpirun
    passes SIGUSR2 on), and the launch hands their 75 back without a restart."""
    import signal
    import socket
    import subprocess
    import time

    from conftest import clean_env

    request.getfixturevalue("openmpi" if launcher == "openmpi" else "mpich")
    where = ["--launcher", launcher]
    if launcher == "hostfile":
        (tmp_path / "hosts").write_text(socket.gethostname() + "\n")
        where = ["--launcher", "mpich", "--hostfile", str(tmp_path / "hosts"), "--run-folder", str(tmp_path / "run")]
    # A rank may get its stop twice (Hydra's proxy signals the wrapper's process group and the
    # wrapper passes it on): a second signal during the trap runs it again, so it says it once.
    # Each rank's stop goes to a file of its own: the launcher may end the job before it has
    # passed on the output of the rank that stopped second.
    rank = (f'trap \'[ -n "$s" ] || {{ s=1; echo stopped >> {tmp_path}/stopped-$RANK; }}; exit 75\' USR2 TERM; '
            f'touch {tmp_path}/ready-$RANK; for i in $(seq 600); do sleep 0.1; done; exit 9')
    process = subprocess.Popen([*ddp_hpc_command(), "launch", *where, "--nproc", "2", "--max-restarts", "1", "--",
                                "sh", "-c", rank], env=clean_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGUSR2)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 75, output[-3000:]
    assert [(tmp_path / f"stopped-{r}").read_text() if (tmp_path / f"stopped-{r}").exists() else None
            for r in (0, 1)] == ["stopped\n", "stopped\n"], output[-3000:]
    assert "restart 1 of 1" not in output, output[-3000:]


def test_record_exit_writes_the_job_s_exit_file_and_stays_out_of_the_help(tmp_path, capsys):
    """``ddp-hpc record-exit RUN JOB_ID STATUS``: what a rendered script runs when its job ends
    before its launch starts (``restart.record_exit``); internal, so not in the help."""
    from ddp_hpc import cli

    args = cli.parse(["record-exit", str(tmp_path), "7_2", "1"])
    assert args.func(args) == 0 and (tmp_path / "exit-7_2").read_text() == "1\n"
    with pytest.raises(SystemExit) as ended:
        cli.parse(["record-exit", str(tmp_path), "7", "x"])
    assert ended.value.code == 2 and "not an exit status (0-255): 'x'" in capsys.readouterr().err
    assert "record-exit" not in cli.build_parser().format_help()


def test_open_mpi_over_a_hostfile_passes_the_users_device_and_backend_to_every_host(tmp_path):
    """Open MPI passes a variable to another host only by name (``-x NAME``): the user's
    ``DDP_HPC_DEVICE``/``DDP_HPC_BACKEND``, where set, go with the others, with or without
    ``--recover``; unset, no ``-x`` names them."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\n")

    def dry_run(*flags: str, **env: str) -> str:
        result = run([*ddp_hpc_command(), "launch", "--launcher", "openmpi", "--hostfile", str(hostfile), "--nodes", "2",
                      "--nproc", "1", "--run-folder", str(tmp_path / "run"), *flags, "--dry-run", "--", "python", "-c",
                      "1"], env={k: v for k, v in clean_env(env).items()
                                 if k not in ("DDP_HPC_DEVICE", "DDP_HPC_BACKEND") or k in env})
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "-x DDP_HPC_BACKEND" in dry_run(DDP_HPC_BACKEND="gloo")
    assert "-x DDP_HPC_DEVICE -x DDP_HPC_BACKEND -x DDP_HPC_RECOVERY_STORE" in dry_run(
        "--recover", "1", DDP_HPC_DEVICE="cpu", DDP_HPC_BACKEND="gloo")
    assert "DDP_HPC_BACKEND" not in dry_run() and "DDP_HPC_DEVICE" not in dry_run()


def test_train_reads_its_config_once_and_names_the_run_after_it(tmp_path, monkeypatch):
    """``ddp-hpc train CONFIG``: the YAML is read once (the CLI's load, handed on to
    ``train()`` with the path that names the run), not once more inside ``train()``."""
    import logging
    import signal

    from ddp_hpc import cli, config
    from ddp_hpc.stop_handler import rank_stop_handler

    reads = []
    real_read = config.read_yaml
    monkeypatch.setattr(config, "read_yaml", lambda path: reads.append(path) or real_read(path))
    for name in ("DDP_HPC_RUN_FOLDER", "DDP_HPC_DEADLINE", "RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    logger = logging.getLogger("ddp_hpc")
    saved = (list(logger.handlers), logger.level, logger.propagate, signal.getsignal(signal.SIGUSR2))
    args = cli.parse(["train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=128",
                      "job.params.val_samples=32", "job.params.input_dim=8", "job.params.hidden=8",
                      "job.params.depth=1", "training.epochs=1", "logging.progress=never", "logging.plot=false",
                      f"logging.run_dir={tmp_path}"])
    try:
        assert args.func(args) == 0
    finally:
        rank_stop_handler().give_back()  # what the CLI's record_stop_signals took
        signal.signal(signal.SIGUSR2, saved[3])
        for handler in [h for h in logger.handlers if h not in saved[0]]:
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(saved[1])
        logger.propagate = saved[2]
    assert reads == [str(REPO / "configs" / "synthetic.yaml")]
    assert (tmp_path / "synthetic" / "summary.json").exists()


def test_in_job_recovery_given_up_under_a_ddp_hpc_verb_is_one_line_and_status_1(capsys):
    """``ddp-hpc train`` under ``launch --recover`` whose launch gave up: the rank's
    ``RecoveryError`` is the fall-back working, said in one line with status 1 (a failure: the
    launch restarts in place), its traceback only with ``--debug`` (issue 44)."""
    import argparse

    from ddp_hpc import cli
    from ddp_hpc.engine.recovery.errors import RecoveryError

    def given_up(args):
        raise RecoveryError("rank 1: the launch gave up in-job recovery after losing rank 2 (exit 137 (SIGKILL))")

    assert cli._run(argparse.Namespace(func=given_up, debug=False)) == 1
    assert capsys.readouterr().err == (
        "ddp-hpc: rank 1: the launch gave up in-job recovery after losing rank 2 (exit 137 (SIGKILL))\n")
    with pytest.raises(RecoveryError):
        cli._run(argparse.Namespace(func=given_up, debug=True))

"""The bad-input corpus: each case exits 2 with one line naming the problem, shows no
traceback (``--debug`` does), and leaves the run folder empty.

Each case is a CLI process forked from one that imported the CLI and torch once
(tests/forked_cli.py): a fresh interpreter per case was 3 minutes of the suite, nearly all
of it ``import torch``. ``test_the_console_script_says_what_the_forked_cli_says`` runs one
case of each group through the console script as well."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, clean_env, ddp_hpc_command, run

pytestmark = pytest.mark.reliability

DIGITS = str(REPO / "configs" / "digits.yaml")
TRAIN = ["train", DIGITS]

# (name, files to write {name: text}, argv with {tmp}, extra environment, expected fragment)
CORPUS = [
    ("malformed YAML", {"c.yaml": "training:\n  epochs: [1,\n"}, ["train", "{tmp}/c.yaml"], {},
     "c.yaml at line 3, column 1: expected the node content, but found '<stream end>'"),
    ("top level not a mapping", {"c.yaml": "- a\n- b\n"}, ["train", "{tmp}/c.yaml"], {}, "c.yaml: the top level must be a mapping of sections"),
    ("YAML that builds objects", {"c.yaml": "job: !!python/object/apply:os.system [id]\n"},
     ["train", "{tmp}/c.yaml"], {},
     "c.yaml at line 1, column 6: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object"),
    ("config file missing", {}, ["train", "{tmp}/missing.yaml"], {}, "cannot read config {tmp}/missing.yaml: No such file or directory"),
    ("unknown key", {}, [*TRAIN, "training.batchsize=4"], {}, "unknown key 'training.batchsize'"),
    ("unknown section", {}, [*TRAIN, "optimiser.lr=1"], {}, "unknown key 'optimiser'"),
    ("wrong type", {}, [*TRAIN, "training.epochs=ten"], {}, "training.epochs: expected int, got 'ten'"),
    ("deadline margin neither seconds nor auto", {}, [*TRAIN, "checkpoint.deadline_margin_s=soon"], {},
     "checkpoint.deadline_margin_s: expected float or 'auto' or null, got 'soon'"),
    ("negative batch size", {}, [*TRAIN, "training.batch_size=-8"], {}, "training.batch_size must be > 0"),
    ("zero epochs", {}, [*TRAIN, "training.epochs=0"], {}, "training.epochs must be > 0"),
    ("grad accumulation 0", {}, [*TRAIN, "training.grad_accum_steps=0"], {}, "training.grad_accum_steps must be > 0"),
    ("unknown precision", {}, [*TRAIN, "training.precision=fp8"], {},
     "training.precision: expected one of 'auto', 'fp32', 'bf16', 'fp16', got 'fp8'"),
    ("override without value", {}, [*TRAIN, "training.lr"], {}, "is not KEY=VALUE"),
    ("run name with a slash", {}, [*TRAIN, "logging.name=a/b"], {}, "logging.name 'a/b' must be a plain folder name"),
    ("missing job module", {}, [*TRAIN, "job.name=nosuchpkg.jobs:Job"], {}, "cannot import module 'nosuchpkg.jobs'"),
    ("unknown job parameter", {}, [*TRAIN, "job.params.layers=3"], {},
     "job.params for 'digits': DigitsJob.__init__() got an unexpected keyword argument 'layers'"),
    ("unreadable data path", {}, [*TRAIN, "job.params.data_path={tmp}/none.npz"], {},
     "job.params.data_path '{tmp}/none.npz' cannot be read as an .npz with 'images' and 'target': [Errno 2] No such file"),
    ("data file without the arrays", {"bad.npz": None}, [*TRAIN, "job.params.data_path={tmp}/bad.npz"], {},
     "cannot be read as an .npz with 'images' and 'target'"),
    ("nccl for CPU tensors", {}, [*TRAIN, "distributed.backend=nccl", "--device", "cpu"], {},
     "backend 'nccl' cannot communicate cpu tensors"),
    pytest.param("xpu without an XPU", {}, [*TRAIN, "--device", "xpu"], {}, "device 'xpu' was requested",
                 marks=pytest.mark.skipif(hasattr(torch, "xpu") and torch.xpu.is_available(),
                                          reason="this host has an XPU: requesting one is not bad input here")),
    pytest.param("cuda without a GPU", {}, [*TRAIN, "--device", "cuda"], {}, "device 'cuda' was requested",
                 marks=pytest.mark.skipif(torch.cuda.is_available(),
                                          reason="this host has a CUDA device: requesting one is not bad input here")),
    ("conflicting rank variables", {}, TRAIN,
     {"RANK": "1", "WORLD_SIZE": "2", "PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
     "launcher variables disagree"),
    ("port out of range", {}, TRAIN, {"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range"),
    ("unknown cluster profile", {}, ["render", "pbs", DIGITS, "--cluster", "auroa"], {}, "unknown cluster profile"),
    ("ranks per node above devices per node", {}, ["render", "pbs", DIGITS, "--cluster", "polaris",
                                                   "--ranks-per-node", "8"], {}, "8 ranks per node"),
    ("walltime nonsense", {}, ["render", "slurm", DIGITS, "--cluster", "slurm-cpu", "--walltime", "1:99:00"], {},
     "--walltime '1:99:00': minutes and seconds must be below 60"),
    ("bench start-up size of one rank", {}, ["bench", "--quick", "--startup-sizes", "1,4"], {},
     "--startup-sizes '1,4': world sizes of at least 2"),
    ("bench start-up sizes not numbers", {}, ["bench", "--startup-sizes", "two"], {},
     "--startup-sizes 'two': give world sizes as N,N,..."),
    ("bench scale sizes not numbers", {}, ["bench", "scale", "256,lots"], {}, "bench scale '256,lots': give world sizes"),
    ("bench mfu on no rank", {}, ["bench", "mfu", "--ranks", "0"], {}, "bench mfu --ranks 0: give at least 1"),
    ("bench old switch beside a mode", {}, ["bench", "--goodput", "mfu"], {},
     "bench mfu: --goodput choose(s) another benchmark"),
    ("bench two old switches", {}, ["bench", "--mfu", "--goodput"], {}, "bench: --mfu and --goodput each choose a "
     "benchmark: give one (bench mfu ...)"),
    ("bench scale check of two sizes", {}, ["bench", "scale", "256", "--check", "8,16"], {},
     "bench scale --check '8,16': one world size"),
    # Configs that are not UTF-8 or not YAML at all.
    ("config not UTF-8", {"c.yaml": b"\xff\xfe\x00\x81training: 1\n"}, ["train", "{tmp}/c.yaml"], {},
     "c.yaml is not UTF-8 text (byte 0xff at offset 0)"),
    ("config is a binary file", {"c.npz": None}, ["train", "{tmp}/c.npz"], {}, "c.npz is not UTF-8 text"),
    ("config indented with a tab", {"c.yaml": "\ttraining:\n  epochs: 1\n"}, ["train", "{tmp}/c.yaml"], {},
     "c.yaml at line 1, column 1: found character '\\t' that cannot start any token"),
    ("config in prose", {"c.yaml": "this is: not: yaml\n"}, ["train", "{tmp}/c.yaml"], {},
     "c.yaml at line 1, column 13: mapping values are not allowed here"),
    ("config is a folder", {}, ["train", "{tmp}"], {}, "cannot read config {tmp}: Is a directory"),
    ("section that is a list", {"c.yaml": "training: [1, 2]\n"}, ["train", "{tmp}/c.yaml"], {},
     "training: expected a mapping of keys, got [1, 2]"),
    # Values of the wrong type or out of range.
    ("list for an int", {}, [*TRAIN, "training.epochs=[1,2]"], {}, "training.epochs: expected int, got [1, 2]"),
    ("word for a bool", {}, [*TRAIN, "training.deterministic=maybe"], {}, "training.deterministic: expected bool"),
    ("word for a float", {}, [*TRAIN, "training.lr=fast"], {}, "training.lr: expected float, got 'fast'"),
    ("unknown optimizer", {}, [*TRAIN, "training.optimizer=adam2"], {}, "training.optimizer: expected one of"),
    ("keep no checkpoint", {}, [*TRAIN, "checkpoint.keep_last=0"], {}, "checkpoint.keep_last must be > 0"),
    ("rendezvous timeout 0", {}, [*TRAIN, "distributed.rendezvous_timeout_s=0"], {},
     "distributed.rendezvous_timeout_s must be > 0"),
    ("negative watchdog", {}, [*TRAIN, "distributed.watchdog_s=-1"], {}, "distributed.watchdog_s must be > 0"),
    ("weights check every 0 steps", {}, [*TRAIN, "distributed.weights_check_every=0"], {},
     "distributed.weights_check_every must be > 0"),
    # training.strategy=fsdp2 with what cannot work on shards.
    ("ZeRO under fsdp2", {}, [*TRAIN, "training.strategy=fsdp2", "training.zero_optimizer=true"], {},
     "training.zero_optimizer cannot be used with training.strategy=fsdp2: fsdp2 shards the optimizer state already"),
    ("fsdp.wrap names a class the model lacks", {}, [*TRAIN, "training.strategy=fsdp2", "fsdp.wrap=[Block]"], {},
     "fsdp.wrap names Block, which the model does not contain (its module classes: "),
    # A run folder that cannot be created.
    ("run folder under a file", {"afile": "x"}, [*TRAIN, "logging.run_dir={tmp}/afile/runs"], {},
     "afile/runs/digits cannot be created: {tmp}/afile is not a folder"),
    ("run folder where nothing can be made", {}, [*TRAIN, "logging.run_dir=/proc/ddp-hpc-runs"], {},
     "run folder /proc/ddp-hpc-runs/digits cannot be created in /proc"),
    # Checkpoints that are not this job's.
    ("checkpoint from another job", {"other.pt": "checkpoint of synthetic"},
     [*TRAIN, "checkpoint.resume={tmp}/other.pt"], {}, "other.pt was written by job 'synthetic', this run's job is "
     "'digits'"),
    ("checkpoint that is a text file", {"notes.pt": "hello\n"}, [*TRAIN, "checkpoint.resume={tmp}/notes.pt"], {},
     "checkpoint {tmp}/notes.pt is not a checkpoint file: its bytes are not what torch.save writes (text, or "
     "another kind of file)"),
    ("checkpoint missing", {}, [*TRAIN, "checkpoint.resume={tmp}/none.pt"], {}, "none.pt does not exist"),
    ("dcp pointer naming no folder", {"last.dcp": "lost\n"}, [*TRAIN, "checkpoint.resume={tmp}/last.dcp"], {},
     "last.dcp names no checkpoint folder (it should hold one line, step-NNNNNNNN)"),
    ("single file named for dcp", {"a.pt": "x"}, [*TRAIN, "checkpoint.format=dcp", "checkpoint.resume={tmp}/a.pt"], {},
     "a.pt is a single file (checkpoint.format=file), and this run reads format dcp: resume it with "
     "checkpoint.format=file"),
    # Environment variables that disagree or make no sense.
    ("rank beyond the world size", {}, TRAIN, {"RANK": "3", "WORLD_SIZE": "2"}, "rank 3 outside [0, 2)"),
    ("world size not a number", {}, TRAIN, {"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
    ("port not a number", {}, TRAIN, {"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a port number"),
    ("unknown device variable", {}, TRAIN, {"DDP_HPC_DEVICE": "tpu"}, "unknown device 'tpu'"),
    ("unknown backend variable", {}, TRAIN, {"DDP_HPC_BACKEND": "mpi"}, "unknown backend 'mpi'"),
    ("console ranks variable nonsense", {}, TRAIN, {"DDP_HPC_CONSOLE_RANKS": "rank0"},
     "DDP_HPC_CONSOLE_RANKS 'rank0': expected ranks like 0 or 0,3 or 0-3, 'all' or 'none'"),
    ("--console-ranks backwards", {}, [*TRAIN, "--console-ranks", "3-1"], {},
     "--console-ranks '3-1': expected ranks like 0 or 0,3 or 0-3"),
    ("rendezvous timeout not a number", {}, TRAIN, {"DDP_HPC_RENDEZVOUS_TIMEOUT": "soon"},
     "DDP_HPC_RENDEZVOUS_TIMEOUT='soon' is not a number of seconds"),
    ("gloo interface this host lacks", {}, TRAIN, {"GLOO_SOCKET_IFNAME": "nope0"},
     "GLOO_SOCKET_IFNAME=nope0 names interface 'nope0', which this host does not have (it has: "),
    ("gloo interface this host lacks, ddp-hpc run", {}, ["run", "--", "touch", "{tmp}/ran"],
     {"GLOO_SOCKET_IFNAME": "lo,nope0"},
     "GLOO_SOCKET_IFNAME=lo,nope0 names interface 'nope0'"),
    ("Open MPI and Hydra disagree", {}, TRAIN,
     {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
      "MPI_LOCALNRANKS": "2"}, "launcher variables disagree"),
    ("ranks on two nodes, no master address", {}, TRAIN,
     {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "ranks span 2 nodes but nothing says where rank 0 runs"),
    # Flags of every command with a value of the wrong type.
    ("--device unknown", {}, [*TRAIN, "--device", "tpu"], {}, "unknown device 'tpu'"),
    ("--backend unknown", {}, [*TRAIN, "--backend", "mpi"], {}, "unknown backend 'mpi'"),
    ("--nodes zero", {}, ["render", "slurm", DIGITS, "--cluster", "slurm-cpu", "--nodes", "0"], {}, "--nodes 0 must be >= 1"),
    ("--stage-dir relative", {}, ["render", "slurm", DIGITS, "--cluster", "slurm-cpu", "--stage-env", "--stage-dir", "scratch"], {},
     "--stage-dir 'scratch' must be an absolute path"),
    ("--stage-env with submitit", {}, ["submit", "slurm", DIGITS, "--cluster", "slurm-cpu", "--stage-env", "--dry-run"], {},
     "--stage-env copies the environment in a step before the ranks in a batch script"),
    ("stage fan-out without a root", {}, ["stage", "fan-out", "{tmp}/env.tar", "--rendezvous", "{tmp}"], {},
     "no node-local folder: give --root DIR or set $DDP_HPC_STAGE_ROOT"),
    ("--env without a value", {}, ["render", "slurm", DIGITS, "--cluster", "slurm-cpu", "--env", "FOO"], {}, "--env 'FOO' is not NAME=VALUE"),
    ("--walltime a word", {}, ["render", "pbs", DIGITS, "--cluster", "pbs-generic", "--walltime", "soon"], {},
     "--walltime 'soon': use HH:MM:SS, MM:SS or whole minutes"),
    ("--recover with submitit", {}, ["submit", "slurm", DIGITS, "--cluster", "slurm-cpu", "--recover", "1", "--dry-run"], {},
     "--recover runs the ranks under ddp-hpc launch's node supervisors in a batch script: use it with --sbatch"),
    ("--recover negative", {}, ["render", "slurm", DIGITS, "--cluster", "slurm-cpu", "--recover", "-1"], {}, "--recover -1 must be >= 0"),
    *[(f"--recover over {backend}", {}, ["launch", "--nproc", "2", "--recover", "1", "--", "python", "-c", "1"],
       {"DDP_HPC_BACKEND": backend}, f"--recover with $DDP_HPC_BACKEND={backend}: in-job recovery runs over gloo and "
                                     f"nccl, not {backend}") for backend in ("xccl", "ccl")],
    ("--recover over nccl on a host without NVIDIA GPUs", {},
     ["launch", "--nproc", "2", "--recover", "1", "--", "python", "-c", "1"], {"DDP_HPC_BACKEND": "nccl"},
     "--recover with $DDP_HPC_BACKEND=nccl: nccl needs NVIDIA or AMD GPUs and this host shows none"),
    ("--recover over xccl through a hostfile", {"hosts": "localhost\n"},
     ["launch", "--launcher", "mpich", "--hostfile", "{tmp}/hosts", "--run-folder", "{tmp}/launch", "--recover", "1",
      "--", "python", "-c", "1"],
     {"DDP_HPC_BACKEND": "xccl"}, "--recover with $DDP_HPC_BACKEND=xccl: in-job recovery runs over gloo and nccl"),
    ("--spare-nodes on PBS without restarts", {}, ["render", "pbs", DIGITS, "--cluster", "pbs-generic", "--spare-nodes", "1"], {},
     "--spare-nodes needs --max-restarts: spare nodes are used by a restart"),
    # Checkpoints: the format, and the checkpoint commands.
    ("unknown checkpoint format", {}, [*TRAIN, "checkpoint.format=zip"], {},
     "checkpoint.format: expected 'file' | 'dcp' or null, got 'zip'"),
    ("dcp checkpoints with ZeRO", {}, [*TRAIN, "checkpoint.format=dcp", "training.zero_optimizer=true"], {},
     "checkpoint.format dcp cannot save training.zero_optimizer's state"),
    ("checkpoint inspect of a folder that is no run", {"notes.txt": "x"}, ["checkpoint", "inspect", "{tmp}"], {},
     "is not a run folder: it has no checkpoints/"),
    ("checkpoint convert of an interrupted checkpoint", {"r/checkpoints/step-00000005/__0_0.distcp": "half"},
     ["checkpoint", "convert", "{tmp}/r", "--step", "5", "{tmp}/model.pt"], {},
     "step-00000005 is incomplete: it has no .metadata (its write was interrupted)"),
    ("a launcher its scheduler does not run", {"srun-pbs.yaml": "scheduler: pbs\nlauncher: srun\nranks_per_node: 1\n"},
     ["render", "pbs", DIGITS, "--cluster", "{tmp}/srun-pbs.yaml"], {},
     "launcher 'srun' does not run under scheduler 'pbs': use one of pals, mpich, openmpi"),
    ("hostfile with MPI's slot counts", {"hosts": "h1:2\n"},
     ["launch", "--launcher", "mpich", "--hostfile", "{tmp}/hosts", "--run-folder", "{tmp}/run", "--", "true"], {},
     "--hostfile {tmp}/hosts, line 1: 'h1:2' is not a host name"),
    ("hostfile under torchrun", {"hosts": "h1\n"},
     ["launch", "--hostfile", "{tmp}/hosts", "--run-folder", "{tmp}/run", "--", "true"], {},
     "--hostfile starts ranks on other hosts through mpiexec: give --launcher openmpi or mpich"),
    ("hostfile without a run folder", {"hosts": "h1\n"},
     ["launch", "--launcher", "mpich", "--hostfile", "{tmp}/hosts", "--nodes", "2", "--", "true"], {},
     "--hostfile needs --run-folder DIR"),
    ("--max-restarts of a chain under submitit", {}, ["submit", "slurm", DIGITS, "--cluster", "slurm-cpu", "--max-restarts", "1",
                                                      "--chain", "2", "--dry-run"], {},
     "--max-restarts under submitit submits one job again: for a sweep or a chain use --sbatch"),
    ("more nodes than the hostfile lists", {"hosts": "h1\nh2\n"},
     ["launch", "--launcher", "mpich", "--hostfile", "{tmp}/hosts", "--nodes", "3", "--run-folder", "{tmp}/run",
      "--", "true"], {}, "--nodes 3: the hostfile lists 2 host(s)"),
    ("hostfile that is not text", {"hosts": b"\xff\xfe\x00h1\n"},
     ["launch", "--launcher", "mpich", "--hostfile", "{tmp}/hosts", "--run-folder", "{tmp}/run", "--", "true"], {},
     "--hostfile {tmp}/hosts: not a text file of host names"),
    ("--torchrun without --launcher srun", {}, ["launch", "--torchrun", "n1:29400", "--", "true"], {},
     "--stop-signal, --requeue and --torchrun go with --launcher srun"),
    ("--torchrun endpoint without a port", {},
     ["launch", "--launcher", "srun", "--torchrun", "n1", "--run-folder", "{tmp}/run", "--", "true"],
     {"SLURM_JOB_NUM_NODES": "1"}, "--torchrun 'n1': give the rendezvous endpoint as HOST:PORT"),
]

# Rerun with --debug (a traceback shows): the first corpus and one case of each later group;
# the rest would add a minute of start-ups to the suite and test the same CLI path.
def case_name(case) -> str:
    """A corpus entry's name: a plain tuple's first item, or a pytest.param's first value."""
    return case.values[0] if hasattr(case, "values") else case[0]


DEBUG_RERUN = {case_name(case) for case in CORPUS[:24]} | {
    "config not UTF-8", "keep no checkpoint", "run folder under a file", "checkpoint from another job",
    "rendezvous timeout not a number", "--nodes zero"}

# argparse's own errors: one line and exit 2 too, but no exception to show with --debug.
FLAG_CORPUS = [
    ("--nodes not a number", ["render", "slurm", DIGITS, "--nodes", "two"], "argument --nodes: invalid int value"),
    ("--ranks-per-node not a number", ["render", "pbs", DIGITS, "--ranks-per-node", "x"],
     "argument --ranks-per-node/--tasks-per-node: invalid int value: 'x'"),
    ("--nproc not a number", ["launch", "--nproc", "two", "--", "true"], "argument --nproc: invalid int value"),
    ("--launcher unknown", ["launch", "--launcher", "slurm", "--", "true"], "argument --launcher: invalid choice"),
    ("bench mode unknown", ["bench", "nope"], "argument MODE: invalid choice: 'nope'"),
    ("doctor --timeout not a number", ["doctor", "--timeout", "soon"], "argument --timeout: invalid float value"),
    ("doctor --link-mib zero", ["doctor", "--links", "--link-mib", "0"], "argument --link-mib: must be > 0, got '0'"),
    ("doctor --min-bandwidth a word", ["doctor", "--links", "--min-bandwidth", "fast"],
     "argument --min-bandwidth: invalid number: 'fast'"),
    ("submit --poll not a number", ["submit", "slurm", DIGITS, "--poll", "often"],
     "argument --poll: invalid float value: 'often'"),
    ("unknown flag", [*TRAIN, "--epochs", "3"], "unrecognized arguments: --epochs 3"),
]


def materialise(tmp_path: Path, files: dict, argv: list[str]) -> list[str]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            np.savez(tmp_path / name, something=np.zeros(3))
        elif isinstance(text, bytes):
            (tmp_path / name).write_bytes(text)
        elif text.startswith("checkpoint of "):  # a whole checkpoint, written by another job
            import torch

            torch.save({"format": 1, "world_size": 1, "config": {"job": {"name": text.split()[-1]}}},
                       tmp_path / name)
        else:
            (tmp_path / name).write_text(text)
    return [a.replace("{tmp}", str(tmp_path)) for a in argv]


def case_argv(tmp_path: Path, files: dict, argv: list[str]) -> list[str]:
    """The case's files written and its argv filled in; ``train`` gets a run folder under tmp_path."""
    argv = materialise(tmp_path, files, argv)
    if argv[0] == "train" and not any(a.startswith("logging.run_dir=") for a in argv):
        argv.append(f"logging.run_dir={tmp_path / 'runs'}")
    return argv


@pytest.mark.parametrize("name,files,argv,env,fragment", CORPUS,
                         ids=[c.values[0] if hasattr(c, "values") else c[0] for c in CORPUS])
def test_bad_input(tmp_path, forked_cli, name, files, argv, env, fragment):
    from ddp_hpc.engine.recovery.backends import host_refusal

    if env.get("DDP_HPC_BACKEND") == "nccl" and "--recover" in argv and host_refusal("nccl") is None:
        pytest.skip("this host shows NVIDIA GPUs: --recover over nccl is taken here")
    argv = case_argv(tmp_path, files, argv)
    before = sorted(tmp_path.rglob("*"))
    result = forked_cli.run(argv, clean_env(env), tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddp-hpc: error: "), result.stderr
    assert fragment.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    assert sorted(tmp_path.rglob("*")) == before, "nothing may be written"
    if name not in DEBUG_RERUN:
        return
    debug = forked_cli.run([*argv, "--debug"], clean_env(env), tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


#: One case of each group of the corpus, through the console script in a fresh interpreter.
CONSOLE_SCRIPT_CASES = ["malformed YAML", "conflicting rank variables", "walltime nonsense", "config not UTF-8",
                        "run folder under a file", "checkpoint that is a text file", "gloo interface this host lacks",
                        "--stage-env with submitit", "hostfile under torchrun"]


@pytest.mark.parametrize("name,files,argv,env,fragment",
                         [case for case in CORPUS if case_name(case) in CONSOLE_SCRIPT_CASES],
                         ids=CONSOLE_SCRIPT_CASES)
def test_the_console_script_says_what_the_forked_cli_says(tmp_path, forked_cli, name, files, argv, env, fragment):
    """The same exit status and the same stderr, byte for byte, from ``ddp-hpc`` started
    afresh as from the fork: nothing the corpus checks depends on the forking."""
    argv = case_argv(tmp_path, files, argv)
    before = sorted(tmp_path.rglob("*"))
    fresh = run([*ddp_hpc_command(), *argv], env=env, cwd=tmp_path)
    forked = forked_cli.run(argv, clean_env(env), tmp_path)
    assert (fresh.returncode, fresh.stderr, fresh.stdout) == (forked.returncode, forked.stderr, forked.stdout)
    assert fresh.returncode == 2 and fragment.replace("{tmp}", str(tmp_path)) in fresh.stderr, fresh.stderr
    assert sorted(tmp_path.rglob("*")) == before, "nothing may be written"


@pytest.mark.parametrize("name,argv,fragment", FLAG_CORPUS, ids=[c[0] for c in FLAG_CORPUS])
def test_bad_flag(tmp_path, forked_cli, name, argv, fragment):
    result = forked_cli.run(argv, clean_env(), tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and re.match(r"ddp-hpc( \w+)*: error: ", lines[0]), result.stderr
    assert fragment in lines[0], lines[0]
    assert not any(tmp_path.rglob("*")), "nothing may be written"


def test_every_case_is_distinct_and_its_fragment_says_what_is_wrong():
    """A fragment that is only a file or key name matches any message about that file."""
    names = [case_name(case) for case in CORPUS] + [case[0] for case in FLAG_CORPUS]
    assert len(names) == len(set(names))
    for case in CORPUS:
        name, fragment = case_name(case), (case.values if hasattr(case, "values") else case)[4]
        words = re.sub(r"\{tmp\}\S*|\S+\.(yaml|npz|pt)\b", "", fragment).split()
        assert len(words) >= 3, f"{name}: {fragment!r} does not say what is wrong"


def test_checkpoint_from_another_model_is_refused(tmp_path, forked_cli):
    first = forked_cli.run([*TRAIN, "training.epochs=1", "job.params.hidden=32", "logging.plot=false",
                            f"logging.run_dir={tmp_path}", "logging.name=small"], clean_env(), REPO)
    assert first.returncode == 0, first.stderr
    checkpoint = tmp_path / "small" / "checkpoints" / "last.pt"
    result = forked_cli.run([*TRAIN, f"checkpoint.resume={checkpoint}", f"logging.run_dir={tmp_path}",
                             "logging.name=big"], clean_env(), REPO)
    assert result.returncode == 2
    assert "is from a different model: head.1.weight has shape [32, 512] there but [64, 512] here" in result.stderr
    assert not (tmp_path / "big").exists()


@pytest.mark.mpi
def test_world_size_larger_than_the_data(tmp_path, mpich):
    result = run([mpich, "-n", "2", *ddp_hpc_command(), "train", str(REPO / "configs" / "synthetic.yaml"),
                  "job.params.samples=1", "job.params.val_samples=0", f"logging.run_dir={tmp_path}"], timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddp-hpc: error:")]
    # Every rank finds it; the first to say so ends the job (Hydra: a PMI abort), naming itself.
    assert lines and all(re.fullmatch(r"ddp-hpc: error: rank [01] on host \S+: world size 2 is larger than the "
                                      r"training set \(1 samples\): use fewer ranks", line) for line in lines), lines
    assert not any(tmp_path.rglob("*"))

"""The bad-input corpus: each case exits 2 with one line naming the problem, shows no
traceback (``--debug`` does), and leaves the run folder empty."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, ddp_hpc_command, run

pytestmark = pytest.mark.reliability

DIGITS = str(REPO / "configs" / "digits.yaml")
TRAIN = ["train", DIGITS]

# (name, files to write {name: text}, argv with {tmp}, extra environment, expected fragment)
CORPUS = [
    ("malformed YAML", {"c.yaml": "training:\n  epochs: [1,\n"}, ["train", "{tmp}/c.yaml"], {}, "c.yaml at line"),
    ("top level not a mapping", {"c.yaml": "- a\n- b\n"}, ["train", "{tmp}/c.yaml"], {}, "must be a mapping"),
    ("YAML that builds objects", {"c.yaml": "job: !!python/object/apply:os.system [id]\n"},
     ["train", "{tmp}/c.yaml"], {}, "c.yaml"),
    ("config file missing", {}, ["train", "{tmp}/missing.yaml"], {}, "cannot read config"),
    ("unknown key", {}, [*TRAIN, "training.batchsize=4"], {}, "unknown key 'training.batchsize'"),
    ("unknown section", {}, [*TRAIN, "optimiser.lr=1"], {}, "unknown key 'optimiser'"),
    ("wrong type", {}, [*TRAIN, "training.epochs=ten"], {}, "training.epochs: expected int, got 'ten'"),
    ("negative batch size", {}, [*TRAIN, "training.batch_size=-8"], {}, "training.batch_size must be > 0"),
    ("zero epochs", {}, [*TRAIN, "training.epochs=0"], {}, "training.epochs must be > 0"),
    ("grad accumulation 0", {}, [*TRAIN, "training.grad_accum_steps=0"], {}, "training.grad_accum_steps must be > 0"),
    ("unknown precision", {}, [*TRAIN, "training.precision=fp8"], {}, "training.precision: expected one of"),
    ("override without value", {}, [*TRAIN, "training.lr"], {}, "is not KEY=VALUE"),
    ("run name with a slash", {}, [*TRAIN, "logging.name=a/b"], {}, "logging.name 'a/b' must be a plain folder name"),
    ("missing job module", {}, [*TRAIN, "job.name=nosuchpkg.jobs:Job"], {}, "cannot import module 'nosuchpkg.jobs'"),
    ("unknown job parameter", {}, [*TRAIN, "job.params.layers=3"], {}, "job.params for 'digits'"),
    ("unreadable data path", {}, [*TRAIN, "job.params.data_path={tmp}/none.npz"], {}, "job.params.data_path"),
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
    ("walltime nonsense", {}, ["render", "slurm", DIGITS, "--walltime", "1:99:00"], {}, "--walltime"),
]


def materialise(tmp_path: Path, files: dict, argv: list[str]) -> list[str]:
    for name, text in files.items():
        if text is None:
            np.savez(tmp_path / name, something=np.zeros(3))
        else:
            (tmp_path / name).write_text(text)
    return [a.replace("{tmp}", str(tmp_path)) for a in argv]


@pytest.mark.parametrize("name,files,argv,env,fragment", CORPUS,
                         ids=[c.values[0] if hasattr(c, "values") else c[0] for c in CORPUS])
def test_bad_input(tmp_path, name, files, argv, env, fragment):
    runs = tmp_path / "runs"
    argv = materialise(tmp_path, files, argv)
    if argv[0] == "train":
        argv.append(f"logging.run_dir={runs}")
    result = run([*ddp_hpc_command(), *argv], env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddp-hpc: error: "), result.stderr
    assert fragment in lines[0]
    assert not runs.exists() or not any(runs.rglob("*")), "the run folder must stay empty"
    debug = run([*ddp_hpc_command(), *argv, "--debug"], env=env, cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_corpus_size():
    assert len(CORPUS) + 2 >= 20  # plus the two below


def test_checkpoint_from_another_model_is_refused(tmp_path):
    first = run([*ddp_hpc_command(), *TRAIN, "training.epochs=1", "job.params.hidden=32",
                 f"logging.run_dir={tmp_path}", "logging.name=small"])
    assert first.returncode == 0, first.stderr
    checkpoint = tmp_path / "small" / "checkpoints" / "last.pt"
    result = run([*ddp_hpc_command(), *TRAIN, f"checkpoint.resume={checkpoint}", f"logging.run_dir={tmp_path}",
                  "logging.name=big"])
    assert result.returncode == 2
    assert "is from a different model: head.1.weight has shape [32, 512] there but [64, 512] here" in result.stderr
    assert not (tmp_path / "big").exists()


@pytest.mark.mpi
def test_world_size_larger_than_the_data(tmp_path, mpich):
    result = run([mpich, "-n", "2", *ddp_hpc_command(), "train", str(REPO / "configs" / "synthetic.yaml"),
                  "job.params.samples=1", "job.params.val_samples=0", f"logging.run_dir={tmp_path}"], timeout=120)
    assert result.returncode == 2
    lines = {line for line in result.stderr.splitlines() if line.startswith("ddp-hpc: error:")}
    assert lines == {"ddp-hpc: error: world size 2 is larger than the training set (1 samples): use fewer ranks"}
    assert not any(tmp_path.rglob("*"))

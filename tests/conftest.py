"""Shared helpers for tests that start real processes (torchrun, mpiexec, srun)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: Set by scripts/test.sh where it installed everything: a missing tool then fails the
#: test instead of skipping it, so CI cannot pass by skipping.
REQUIRE_ALL = os.environ.get("DDP_HPC_REQUIRE_ALL") == "1"
LAUNCHER_PREFIXES = ("OMPI_", "PMI", "PMIX_", "MPI_LOCAL", "SLURM_", "PALS_", "MV2_", "TORCHELASTIC",
                     "PBS_", "HYDRA_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "DDP_HPC_DEVICE", "DDP_HPC_BACKEND", "DDP_HPC_HOST_SUFFIX"}


def need(condition: bool, reason: str) -> None:
    """Skip with ``reason`` unless the tool is required here, then fail."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"required by DDP_HPC_REQUIRE_ALL=1 but missing: {reason}")
    pytest.skip(reason)


def require_module(name: str, extra: str = "test"):
    """Import ``name``; where it is missing, skip (or, under DDP_HPC_REQUIRE_ALL=1, fail) naming
    the extra that installs it. pytest.importorskip would skip even where CI requires it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as error:
        need(False, f"{name} is not installed ({error}): pip install -e '.[{extra}]'")


def ddp_hpc_command() -> list[str]:
    """The ``ddp-hpc`` console script of the interpreter running the tests."""
    script = Path(sys.executable).parent / "ddp-hpc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ddp_hpc"]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without any launcher's variables, so tests behave the same anywhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    env.update(extra or {})
    return env


def run(args: Sequence[str], *, timeout: float = 120, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env=clean_env(env), cwd=cwd or REPO)


@pytest.fixture
def openmpi() -> str:
    program = shutil.which("mpiexec.openmpi")
    need(program is not None, "Open MPI is not installed (apt-get install openmpi-bin)")
    return "mpiexec.openmpi"


@pytest.fixture
def mpich() -> str:
    program = shutil.which("mpiexec.mpich") or shutil.which("mpiexec.hydra")
    need(program is not None, "MPICH is not installed (apt-get install mpich)")
    return Path(program).name


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    up = shutil.which("srun") is not None and subprocess.run(
        ["scontrol", "ping"], capture_output=True, timeout=30).returncode == 0
    need(up, "the SLURM test cluster is not running (scripts/dev-cluster.sh up, as root)")


@pytest.fixture(scope="session")
def qsub(slurm_cluster) -> str:
    """Slurm's PBS wrapper (``qsub``) in front of the test cluster."""
    program = shutil.which("qsub")
    need(program is not None, "qsub is not on PATH (Slurm's PBS wrappers: apt-get install slurm-wlm-torque)")
    return program


def load_last_checkpoint(checkpoints: Path) -> dict:
    """The newest checkpoint in a run's checkpoints folder, either format, as one dict."""
    from ddp_hpc.engine.checkpoint_files import load_checkpoint
    from ddp_hpc.engine.dcp_format import read_whole

    pointer = checkpoints / "last.dcp"
    if pointer.exists():
        return read_whole(checkpoints / pointer.read_text().strip())
    return load_checkpoint(checkpoints / "last.pt")


def assert_same_training_state(expected: dict, actual: dict) -> None:
    """Two checkpoints hold the same progress and bit-identical model and optimizer state."""
    assert actual["progress"] == expected["progress"]
    assert_same_model_and_optimizer(expected, actual)


def assert_same_model_and_optimizer(expected: dict, actual: dict) -> None:
    """Two checkpoints hold bit-identical model weights and optimizer state."""
    import torch

    for key, value in expected["model"].items():
        assert torch.equal(value, actual["model"][key]), key
    for index, state in expected["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, actual["optimizer"]["state"][index][name]), (index, name)


#: Figures measured by reliability and scheduler tests, printed after the run.
FIGURES: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    if FIGURES:
        terminalreporter.section("measured figures")
        for line in FIGURES:
            terminalreporter.write_line(line)

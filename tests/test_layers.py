"""The import-linter contracts in pyproject.toml (docs/architecture.md): they hold, and they
catch a layer crossed or a cycle put back."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from conftest import REPO, run

LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path):
    # lint-imports finds the package on sys.path from its working directory first.
    return run([LINT_IMPORTS, "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, timeout=120)


def test_the_import_contracts_hold():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Contracts: 9 kept, 0 broken." in result.stdout


def test_the_contracts_break_when_tracking_imports_training_launch_imports_a_family_and_a_cycle_is_put_back(
        tmp_path):
    shutil.copytree(REPO / "ddp_hpc", tmp_path / "ddp_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    # The cycle issue 22 broke: loading a config imported the tracker registry, which needs the config.
    registry = tmp_path / "ddp_hpc" / "tracking" / "registry.py"
    registry.write_text(registry.read_text() + "\nfrom ddp_hpc.config import LoggingConfig  # noqa\n")
    config = tmp_path / "ddp_hpc" / "config.py"
    config.write_text(config.read_text() + "\nfrom ddp_hpc.tracking import registry  # noqa\n")
    hub = tmp_path / "ddp_hpc" / "tracking" / "hub.py"
    hub.write_text(hub.read_text() + "\nfrom ddp_hpc.training.metrics import MetricSums  # noqa\n")
    # Process-group start-up reaching up into training.
    doctor = tmp_path / "ddp_hpc" / "startup" / "doctor.py"
    doctor.write_text(doctor.read_text() + "\nfrom ddp_hpc.training import job  # noqa\n")
    # The scheduler verbs used to live in launch/ and import the families, which import launch/.
    request = tmp_path / "ddp_hpc" / "specs" / "request.py"
    request.write_text(request.read_text() + "\nfrom ddp_hpc.schedulers.slurm import render  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "tracking never imports training BROKEN" in result.stdout
    assert "ddp_hpc.tracking.hub -> ddp_hpc.training.metrics" in result.stdout
    assert "no import cycles between sibling modules BROKEN" in result.stdout
    assert "No cycles are allowed in ddp_hpc.\n" in result.stdout and ".tracking -> .config" in result.stdout
    assert "launch is below the scheduler families BROKEN" in result.stdout
    assert "ddp_hpc.specs.request -> ddp_hpc.schedulers.slurm.render" in result.stdout
    # ... and through launch/, pbs and local now reach slurm: the families are no longer independent.
    assert "scheduler families are independent of each other BROKEN" in result.stdout
    assert "run and startup import neither training nor the scheduler side BROKEN" in result.stdout
    assert "ddp_hpc.startup.doctor -> ddp_hpc.training" in result.stdout
    assert "Contracts: 4 kept, 5 broken." in result.stdout

"""The import-linter contracts in pyproject.toml and importlinter-type-hints.ini (the ones that
count type-hint imports too; docs/architecture.md): they hold, and they catch a layer crossed
or a cycle put back."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from conftest import REPO, run

LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path, config: str = "pyproject.toml"):
    # lint-imports finds the package on sys.path from its working directory first.
    return run([LINT_IMPORTS, "--no-cache", "--config", str(root / config)], cwd=root, timeout=120)


def test_the_import_contracts_hold():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Contracts: 11 kept, 0 broken." in result.stdout


def test_the_contracts_break_when_tracking_imports_training_launch_imports_a_family_or_the_top_and_a_cycle_is_put_back(
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
    # The version read from the package's top (the public API) again, as the rendered scripts' header did.
    script = tmp_path / "ddp_hpc" / "launch" / "script.py"
    script.write_text(script.read_text() + "\nfrom ddp_hpc import __version__  # noqa\n")
    # The launch's recovery store served with torch's TCPStore again (issue 44).
    server = tmp_path / "ddp_hpc" / "engine" / "recovery" / "store_server.py"
    server.write_text(server.read_text() + "\nimport torch.distributed  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "the launch's recovery store and its key batches never import torch BROKEN" in result.stdout
    assert "ddp_hpc.engine.recovery.store_server is not allowed to import torch" in result.stdout
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
    assert "nothing inside the package imports its top BROKEN" in result.stdout
    assert "ddp_hpc.launch.script -> ddp_hpc (l." in result.stdout
    assert "Contracts: 4 kept, 7 broken." in result.stdout


TYPE_HINTS = "importlinter-type-hints.ini"


def test_the_type_hint_contracts_hold():
    result = _lint(REPO, TYPE_HINTS)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_the_type_hint_contracts_break_when_a_service_names_the_trainer_in_a_type_hint(tmp_path):
    shutil.copytree(REPO / "ddp_hpc", tmp_path / "ddp_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / TYPE_HINTS, tmp_path)
    # The circle issue 30 removed: a service typed its hooks with the Trainer, which builds it.
    prestage = tmp_path / "ddp_hpc" / "training" / "services" / "prestage.py"
    prestage.write_text(prestage.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                        "    from ddp_hpc.training.trainer import Trainer  # noqa\n")
    result = _lint(tmp_path, TYPE_HINTS)
    assert result.returncode != 0
    assert ("the loop, callbacks and services never import the Trainer, even for type hints BROKEN"
            in result.stdout)
    assert "ddp_hpc.training.services.prestage -> ddp_hpc.training.trainer" in result.stdout
    assert "no import cycle inside training, even for type hints BROKEN" in result.stdout
    assert "- .services -> .trainer" in result.stdout
    assert "Contracts: 0 kept, 2 broken." in result.stdout

"""Tracker names in the config -> the module they need and the class that logs."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ddp_hpc.errors import UserError

if TYPE_CHECKING:
    from ddp_hpc.config import LoggingConfig
    from ddp_hpc.tracking.base import Tracker

#: name -> (the module it imports, the pip extra that installs it)
REQUIREMENTS: dict[str, tuple[str | None, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
    "csv": (None, ""),
}
NAMES = tuple(REQUIREMENTS)


class TrackerNotInstalled(UserError):
    """A tracker named in logging.trackers whose package is missing."""


def check_installed(names: Sequence[str], mlflow_tracking_uri: str | None = None) -> None:
    """Raise (one line, exit 2) if a named tracker's package cannot be imported.

    Called where the trackers will start (``train()``, before any process group), never
    when a config is loaded: submitting from a login node needs no tracker package."""
    for name in names:
        module, extra = REQUIREMENTS[name]
        modules = [module] if module else []
        if name == "mlflow" and (mlflow_tracking_uri is None or mlflow_tracking_uri.startswith("sqlite:")):
            modules += ["sqlalchemy", "alembic"]  # mlflow-skinny's SQLite store needs them
        for needed in modules:
            if importlib.util.find_spec(needed) is None:
                raise TrackerNotInstalled(
                    f"logging.trackers names {name!r}, but the {needed!r} package is not installed: "
                    f"pip install 'ddp_hpc[{extra}]', or remove it from logging.trackers")


def create(name: str, config: LoggingConfig) -> Tracker:
    if name == "tensorboard":
        from ddp_hpc.tracking.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker()
    if name == "mlflow":
        from ddp_hpc.tracking.mlflow_tracker import MlflowTracker

        return MlflowTracker(config.mlflow.tracking_uri, config.mlflow.experiment)
    if name == "wandb":
        from ddp_hpc.tracking.wandb_tracker import WandbTracker

        return WandbTracker(config.wandb.project, config.wandb.entity, config.wandb.mode)
    if name == "csv":
        from ddp_hpc.tracking.csv_tracker import CsvTracker

        return CsvTracker()
    raise ValueError(f"unknown tracker {name!r}")

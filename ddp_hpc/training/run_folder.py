"""``runs/<name>/``: the resolved config, metrics, checkpoints and summary of one run."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ddp_hpc.contract import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    RECORD_DIR,
    STRAGGLERS_FILE,
    SUMMARY_FILE,
    atomic_write,
)
from ddp_hpc.errors import UserError
from ddp_hpc.summary import RunSummary


@dataclass(frozen=True)
class RunFolder:
    path: Path

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary_file(self) -> Path:
        return self.path / SUMMARY_FILE

    def check_creatable(self) -> None:
        """A ``UserError`` now, before any rank starts, if the folder could not be made later.

        Probes the nearest existing ancestor with a temporary folder that is removed at
        once, so nothing is left behind (permissions alone do not tell: root, read-only mounts).
        """
        ancestor = self.path
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise UserError(f"run folder {self.path} cannot be created: {ancestor} is not a folder "
                            "(set logging.run_dir)")
        if ancestor == self.path and os.access(self.path, os.W_OK | os.X_OK) and self.checkpoints.is_dir():
            return  # an existing run being resumed
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".ddp-hpc-probe-", dir=ancestor))
        except OSError as exc:
            raise UserError(f"run folder {self.path} cannot be created in {ancestor}: {exc.strerror} "
                            "(set logging.run_dir)") from None

    def create(self, resolved_config: dict[str, Any]) -> None:
        """Rank 0 only: make the folders and write the resolved config."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path / CONFIG_FILE, yaml.safe_dump(resolved_config, sort_keys=False))

    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_file, "a") as handle:
            handle.write(json.dumps(row, sort_keys=True) + "\n")

    @property
    def stragglers_file(self) -> Path:
        return self.path / RECORD_DIR / STRAGGLERS_FILE

    def write_stragglers(self, stragglers: list[dict[str, Any]]) -> None:
        """Rank 0: every straggler named so far (rank, host, ratio, step), replaced whole."""
        self.stragglers_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.stragglers_file, json.dumps(stragglers, indent=1, sort_keys=True) + "\n")

    def write_summary(self, summary: RunSummary) -> None:
        atomic_write(self.summary_file, summary.to_json())


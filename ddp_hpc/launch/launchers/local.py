"""``--launcher local`` (the old name ``torchrun`` still works): ddp-hpc starts the ranks on
this machine itself, each with torchrun's variables (``local.LocalRanks``), and watches them
under ``--recover`` (``recovering.Recoverer``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ddp_hpc.launch.attempts import Attempts, MarkedAttempts
from ddp_hpc.launch.launchers.base import Launcher, Plan
from ddp_hpc.launch.local import LocalRanks, rank_command
from ddp_hpc.launch.recovering import Recoverer
from ddp_hpc.launch.restart import LaunchEnd

if TYPE_CHECKING:
    from ddp_hpc.launch.spec import LaunchSpec


@dataclass(frozen=True)
class LocalLauncher(Launcher):
    name: ClassVar[str] = "local"
    old_names: ClassVar[tuple[str, ...]] = ("torchrun",)
    listed_at: ClassVar[int] = 10

    def ranks(self, spec: LaunchSpec) -> LocalRanks:
        """Each attempt's ranks (a launcher that runs them locally with variables of its own
        overrides this)."""
        return LocalRanks(spec.nproc, rank_command(spec.command))

    def starts_node_supervisors(self, spec: LaunchSpec) -> bool:
        return False  # this launch watches the ranks itself

    def plan(self, spec: LaunchSpec, folder: Path | None) -> Plan:
        attempts: Attempts = self.ranks(spec)
        in_job = None
        if spec.recovery is not None:
            attempts = in_job = Recoverer(attempts, spec.recovery)
        if folder is not None and spec.run_folder is not None:
            attempts = MarkedAttempts(attempts, folder)
        # A `submit local` script exec's this launch: the job id is its pid.
        return Plan(attempts, in_job, LaunchEnd(spec.run_folder, str(os.getpid())) if spec.run_folder else LaunchEnd())

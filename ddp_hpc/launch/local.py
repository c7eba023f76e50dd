"""Start N ranks on this machine: torchrun, or mpiexec of either MPI."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.errors import UserError
from ddp_hpc.launch.mpi import MpiLaunch, build_mpiexec

LOCAL_LAUNCHERS = ("torchrun", "openmpi", "mpich")


@dataclass(frozen=True)
class LocalLaunch:
    nproc: int
    command: Sequence[str]
    launcher: str = "torchrun"

    def __post_init__(self) -> None:
        if self.launcher not in LOCAL_LAUNCHERS:
            raise UserError(f"unknown launcher {self.launcher!r}: choose one of {', '.join(LOCAL_LAUNCHERS)}")
        if self.nproc < 1:
            raise UserError(f"--nproc {self.nproc} must be >= 1")
        if not self.command:
            raise UserError("no command to launch: give it after '--', e.g. -- ddp-hpc doctor")


def build_torchrun(nproc: int, command: Sequence[str]) -> list[str]:
    """torchrun on this node only; ``--no-python`` runs any executable (``ddp-hpc ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--no-python", *command]


def rank_command(command: Sequence[str]) -> list[str]:
    """Every rank runs a foreign command through ``ddp-hpc run`` (torchrun's variables under
    any launcher); ddp-hpc's own verbs resolve their rank by themselves."""
    own = Path(command[0]).name == "ddp-hpc" or list(command[1:3]) == ["-m", "ddp_hpc"]
    return list(command) if own else ["ddp-hpc", "run", "--", *command]


def build_local_command(launch: LocalLaunch) -> list[str]:
    command = rank_command(launch.command)
    if launch.launcher == "torchrun":
        return build_torchrun(launch.nproc, command)
    return build_mpiexec(MpiLaunch(launch.launcher, nodes=1, ranks_per_node=launch.nproc,
                                   command=command, oversubscribe=True,
                                   allow_root=os.geteuid() == 0))

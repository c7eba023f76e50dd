"""``ddp-hpc launch`` on this machine: what starts the ranks (ddp-hpc itself with torchrun's
variables, or mpiexec of either MPI); ``launch/supervisor.py`` runs and restarts them."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.errors import UserError
from ddp_hpc.contract import RUN_FOLDER_VAR
from ddp_hpc.launch.mpi import STOP_STATUS_LOST, MpiLaunch, build_mpiexec
from ddp_hpc.launch.script import recording_rank_failures, split_staged
from ddp_hpc.launch.supervisor import LocalRanks, OneLauncher

LOCAL_LAUNCHERS = ("torchrun", "openmpi", "mpich")


@dataclass(frozen=True)
class LocalLaunch:
    nproc: int
    command: Sequence[str]
    launcher: str = "torchrun"
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.launcher not in LOCAL_LAUNCHERS:
            raise UserError(f"unknown launcher {self.launcher!r}: choose one of {', '.join(LOCAL_LAUNCHERS)}")
        if self.nproc < 1:
            raise UserError(f"--nproc {self.nproc} must be >= 1")
        if not self.command:
            raise UserError("no command to launch: give it after '--', e.g. -- ddp-hpc doctor")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts} must be >= 0")


def build_torchrun(nproc: int, command: Sequence[str]) -> list[str]:
    """torchrun on this node only, without restarts (the benchmarks time it against the
    other launchers); ``--no-python`` runs any executable (``ddp-hpc ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--no-python", *command]


def rank_command(command: Sequence[str]) -> list[str]:
    """Every rank runs a foreign command through ``ddp-hpc run`` (torchrun's variables under
    any launcher); ddp-hpc's own verbs resolve their rank by themselves. ``ddp-hpc run`` is
    the launch's own interpreter's (``python -m ddp_hpc``), not a name looked up on PATH: a
    launch started by its path, without its environment on PATH, works. A command in the
    staged wrapper (``--stage-env``) keeps it outermost, and ``ddp-hpc run`` by name: the
    node's copy's, first on the PATH the wrapper sets."""
    staged, command = split_staged(command)
    own = not command or Path(command[0]).name == "ddp-hpc" or list(command[1:3]) == ["-m", "ddp_hpc"]
    ddp_hpc = ["ddp-hpc"] if staged else [sys.executable, "-m", "ddp_hpc"]
    return [*staged, *(command if own else [*ddp_hpc, "run", "--", *command])]


def attempt_starter(launch: LocalLaunch, run_folder: Path | None = None) -> LocalRanks | OneLauncher:
    """What starts each attempt's ranks: ddp-hpc itself (``torchrun``: torchrun's variables,
    no torchrun), or one mpiexec (``mpiexec_here``)."""
    command = rank_command(launch.command)
    if launch.launcher == "torchrun":
        return LocalRanks(launch.nproc, command)
    return mpiexec_here(launch.launcher, launch.nproc, command, run_folder)


def mpiexec_here(flavour: str, tasks: int, command: Sequence[str], run_folder: Path | None,
                 forward: Sequence[str] = ()) -> OneLauncher:
    """One mpiexec of ``tasks`` tasks on this machine (the ranks, or a node supervisor), which
    see ``run_folder`` as ``$DDP_HPC_RUN_FOLDER``; under MPICH each runs in the wrapper that
    says there that rank 0 stopped (``mpi.STOP_STATUS_LOST``)."""
    env = dict(os.environ)
    if run_folder is not None:
        env[RUN_FOLDER_VAR] = str(run_folder)
        if flavour in STOP_STATUS_LOST:
            command = recording_rank_failures(command)
    return OneLauncher(build_mpiexec(MpiLaunch(flavour, nodes=1, ranks_per_node=tasks, command=list(command),
                                               forward=tuple(forward), oversubscribe=True,
                                               allow_root=os.geteuid() == 0)), env)


def describe(starter: LocalRanks | OneLauncher, launch: LocalLaunch) -> str:
    """``--dry-run``: what each attempt starts (``attempt_starter``'s), and the restarts."""
    restarts = f"at most {launch.max_restarts} restart(s) after a failure, none after a stop (75)"
    if isinstance(starter, OneLauncher):
        return f"{shlex.join(starter.argv)}\n# {restarts}\n"
    return (f"# {launch.nproc} ranks, each with torchrun's worker variables (RANK, LOCAL_RANK, WORLD_SIZE, "
            f"MASTER_ADDR, MASTER_PORT, ...); rank 0 serves a fresh store on a free port each attempt; {restarts}\n"
            f"{shlex.join(starter.command)}\n")

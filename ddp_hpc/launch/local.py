"""``ddp-hpc launch`` on this machine: two ``Attempts`` (launch/attempts.py), each rank a child
of the launch with torchrun's variables (``LocalRanks``, ``--launcher local``), or one
mpiexec of either MPI (``MpiexecHere``, ``--launcher openmpi|mpich``)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc.contract import RESTART_COUNT_VAR, RUN_FOLDER_VAR
from ddp_hpc.device import NCCL_ERROR_HANDLING_VAR
from ddp_hpc.environment import DistEnv
from ddp_hpc.environment.ports import free_port
from ddp_hpc.launch.attempts import signal_running, start_all
from ddp_hpc.launch.mpi import MpiLaunch, build_mpiexec, mpi_flavour
from ddp_hpc.launch.script import recording_rank_failures, split_staged
from ddp_hpc.run.torchrun_env import torchrun_variables


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


@dataclass(frozen=True)
class LocalRanks:
    """``nproc`` ranks of ``command`` on this machine, each with torchrun's worker variables
    (``torch/distributed/elastic/agent/server/local_elastic_agent.py``, ``_start_workers``):
    scripts written for torchrun and ddp_hpc's own verbs (``TorchrunEnvironment``) read them."""

    nproc: int
    command: Sequence[str]
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    #: A node supervisor's (``launch/node.py``): this node's place among ``num_nodes``, each
    #: with ``nproc`` ranks, and where they meet.
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"

    @property
    def world_size(self) -> int:
        return self.nproc * self.num_nodes

    def environment(self, local_rank: int, attempt: int, port: int, run_id: str) -> dict[str, str]:
        rank = DistEnv(rank=self.node_rank * self.nproc + local_rank, world_size=self.world_size,
                       local_rank=local_rank, local_world_size=self.nproc, node_rank=self.node_rank,
                       num_nodes=self.num_nodes, master_addr=self.master_addr, master_port=port,
                       source="ddp-hpc launch")
        env = {**self.base_env, **torchrun_variables(rank, run_id, attempt), RESTART_COUNT_VAR: str(attempt)}
        env.setdefault(NCCL_ERROR_HANDLING_VAR, "1")
        if self.nproc > 1 and not env.get("OMP_NUM_THREADS", "").strip():
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: ranks sharing a node do not oversubscribe it
        return env

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> list[subprocess.Popen]:
        """Every rank of attempt ``attempt``; rank 0 serves a fresh store on a free port."""
        port, run_id = free_port(), uuid.uuid4().hex[:12]
        return start_all([(self.command, {**self.environment(local_rank, attempt, port, run_id), **(extra_env or {})})
                          for local_rank in range(self.nproc)])

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        signal_running(children, signum)

    def read_status(self, attempt: int, status: int) -> int:
        return status

    def describe(self) -> str:
        return (f"# {self.nproc} ranks, each with torchrun's worker variables (RANK, LOCAL_RANK, WORLD_SIZE, "
                f"MASTER_ADDR, MASTER_PORT, ...); rank 0 serves a fresh store on a free port each attempt\n"
                f"{shlex.join(self.command)}\n")


@dataclass(frozen=True)
class MpiexecHere:
    """One mpiexec per attempt on this machine, which starts the ranks itself (or, under
    ``--recover``, one node supervisor). Each attempt's ranks meet on a free port (unless
    ``MASTER_PORT`` is set): a rank of one machine otherwise derives it from its parent, which
    the rank wrapper replaces."""

    argv: Sequence[str]
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> list[subprocess.Popen]:
        env = {**self.base_env, RESTART_COUNT_VAR: str(attempt), **(extra_env or {})}
        if not env.get("MASTER_PORT", "").strip():
            env["MASTER_PORT"] = str(free_port())
        return start_all([(self.argv, env)])

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        signal_running(children, signum)

    def read_status(self, attempt: int, status: int) -> int:
        return status

    def describe(self) -> str:
        return f"{shlex.join(self.argv)}\n"


def mpiexec_here(flavour: str, tasks: int, command: Sequence[str], run_folder: Path | None,
                 forward: Sequence[str] = ()) -> MpiexecHere:
    """One mpiexec of ``tasks`` tasks on this machine (the ranks, or a node supervisor), which
    see ``run_folder`` as ``$DDP_HPC_RUN_FOLDER``; under MPICH each runs in the wrapper that
    says there that rank 0 stopped (``MpiFlavour.loses_stop_status``)."""
    env = dict(os.environ)
    if run_folder is not None:
        env[RUN_FOLDER_VAR] = str(run_folder)
        if mpi_flavour(flavour).loses_stop_status:
            command = recording_rank_failures(command)
    return MpiexecHere(build_mpiexec(MpiLaunch(flavour, nodes=1, ranks_per_node=tasks, command=list(command),
                                               forward=tuple(forward), oversubscribe=True,
                                               allow_root=os.geteuid() == 0)), env)

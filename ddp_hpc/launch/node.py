"""In-job recovery under a launcher that ends every task when one fails (mpiexec of MPICH or
Open MPI, srun): a supervisor per node (issue 31).

The launcher starts one task per node, a *node supervisor* (``ddp-hpc launch
--node-supervisor``): the launch's ``Supervisor`` with no restarts of its own and
``LocalRanks`` given the node's place, around the same ``Recoverer`` as on one machine
(``launch/recovering.py``), a client of the recovery store the outer launch serves
(``$DDP_HPC_RECOVERY_STORE``). A lost rank is the node supervisor's child: it starts a
replacement there while every other rank, on every node, stays up, and the launcher sees
nothing (its task still runs). A node supervisor exits when its ranks do (0, 75) or when
recovery is spent (the ranks' failure): then the launcher ends the others and the outer
launch restarts in place, its one restart loop (``NodeSupervisors``, a wrapper around the
launcher's ``Attempts``: mpiexec here, mpiexec over a hostfile, srun).

After torchrun's elastic agent (one agent per node, the launcher's task, a store for
membership), without its restart of every worker on a failure.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddp_hpc.contract import HOST_SUFFIX_VAR, RECOVERY_STORE_VAR
from ddp_hpc.environment import detect_launcher
from ddp_hpc.environment.launchers import TorchrunEnvironment
from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import Attempts
from ddp_hpc.launch.recovering import RecoveryLimits

#: The variables that make a process a launcher's task (environment/launchers.py reads
#: them): the node supervisor has them, its ranks must not, or they would read the node
#: supervisor's place (rank 0 of 1 per node) instead of their own, and an MPI library in
#: them would take itself for the launcher's task.
TASK_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "MPIR_", "HYDRA_", "HYDI_", "PALS_", "MV2_COMM_WORLD_")
TASK_NAMES = frozenset({"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_GTIDS", "SLURM_TASK_PID",
                        "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE",
                        "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                        "SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE", "SLURM_CPU_BIND_VERBOSE"})


def rank_base_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The node supervisor's environment without its launcher's task variables: what its
    ranks start from (``LocalRanks`` adds torchrun's)."""
    return {name: value for name, value in environ.items()
            if not name.startswith(TASK_PREFIXES) and name not in TASK_NAMES and name != RECOVERY_STORE_VAR}


def node_place(environ: Mapping[str, str]) -> tuple[int, int]:
    """``(node rank, nodes)``: the node supervisor is the launcher's task ``node rank`` of
    ``nodes`` (one per node); started by hand, node 0 of 1."""
    launcher = detect_launcher(environ)
    if isinstance(launcher, TorchrunEnvironment):
        raise UserError("ddp-hpc launch --node-supervisor is a launcher's task (mpiexec -ppn 1, srun "
                        "--ntasks-per-node=1), not a torchrun worker")
    info = launcher.ranks(environ)
    if info.local_world_size != 1:
        raise UserError(f"ddp-hpc launch --node-supervisor runs once per node; {launcher.name} started "
                        f"{info.local_world_size} on this one (use -ppn 1 / --ntasks-per-node=1)")
    return info.rank, info.world_size


def node_supervisor_command(nproc: int, limits: RecoveryLimits, command: Sequence[str]) -> list[str]:
    """What the launcher runs once per node."""
    argv = [sys.executable, "-m", "ddp_hpc", "launch", "--node-supervisor", "--nproc", str(nproc),
            "--recover", str(limits.max_recoveries), "--recovery-wait", f"{limits.wait_s:g}",
            "--hang-timeout", f"{limits.hang_s:g}"]
    if limits.shrink:
        argv.append("--shrink")
    if limits.warm_spare:
        argv.append("--warm-spare")
    return [*argv, "--", *command]


def store_host(environ: Mapping[str, str], local: bool) -> str:
    """Where the node supervisors reach the outer launch's store: loopback when they all run
    on this machine (``local``); else this host's name (with the cluster's ``$DDP_HPC_HOST_SUFFIX``), or, where that
    name means loopback (Debian's /etc/hosts), its first address on another interface."""
    from ddp_hpc.environment.hosts import with_suffix
    from ddp_hpc.environment.netcheck import is_loopback, local_interfaces, resolve_addresses

    if local:
        return "127.0.0.1"
    name = with_suffix(socket.gethostname(), environ.get(HOST_SUFFIX_VAR, ""))
    if not all(is_loopback(address) for address in resolve_addresses(name) or ("127.0.0.1",)):
        return name
    for addresses in local_interfaces().values():
        for address in addresses:
            if not is_loopback(address):
                return address
    return name


@dataclass
class NodeSupervisors:
    """The outer launch's side, around any ``Attempts`` whose tasks are node supervisors:
    serves a fresh recovery store each attempt (``host``: the address the node supervisors
    reach it at) and puts its address into the attempt's environment, the one way; a stop
    goes to them through the store (``forward_stop``), not through the launcher (MPICH's Hydra
    does not pass SIGUSR2 on; it dies of it)."""

    attempts: Attempts
    host: str = "127.0.0.1"
    _store: Any = None

    def describe(self) -> str:
        """``--dry-run``: the launcher's, whose tasks are the node supervisors."""
        return self.attempts.describe()

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> Sequence[subprocess.Popen]:
        from ddp_hpc.engine.recovery.store import LaunchStore

        if self._store is not None:
            self._store.close()  # the last attempt's: its node supervisors are gone
        self._store = LaunchStore(self.host)
        return self.attempts.start(attempt, {**(extra_env or {}), RECOVERY_STORE_VAR: self._store.address})

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        if self._store is not None:
            self._store.request_stop(signum)

    def read_status(self, attempt: int, status: int) -> int:
        return self.attempts.read_status(attempt, status)

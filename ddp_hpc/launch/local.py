"""Start N ranks on this machine: torchrun, or mpiexec of either MPI."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import AGREED_EXIT_STATUSES, RESTART_COUNT_VAR, ExitStatus
from ddp_hpc.errors import UserError
from ddp_hpc.launch.mpi import MpiLaunch, build_mpiexec

log = logging.getLogger(__name__)

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

    @property
    def restarts_here(self) -> bool:
        """mpiexec has no restarts of its own: ddp-hpc relaunches it."""
        return self.max_restarts > 0 and self.launcher != "torchrun"


#: torchrun's agent hands every restart attempt the same store, unprefixed
#: (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, ``_shared_tcp_store_server``),
#: so a script's own ``init_process_group`` in attempt 1 reads attempt 0's gloo addresses and
#: fails ("connectFullMesh ... Connection refused"). This makes the agent start a fresh store
#: per attempt. ddp_hpc's ``process_group()`` prefixes its keys per attempt and needs it not.
FRESH_STORE_PER_ATTEMPT = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def build_torchrun(nproc: int, command: Sequence[str], max_restarts: int = 0) -> list[str]:
    """torchrun on this node only; ``--no-python`` runs any executable (``ddp-hpc ...``)."""
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    fresh_store = ["env", "=".join(FRESH_STORE_PER_ATTEMPT)] if max_restarts else []
    return [*fresh_store, sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *restarts, "--no-python", *command]


def run_with_restarts(argv: Sequence[str], max_restarts: int) -> int:
    """Run the launch; after a failure (not OK, not REQUEUE: stopped on request) run it again,
    at most ``max_restarts`` times, with ``$DDP_HPC_RESTART_COUNT`` set. The ranks resume
    from the newest checkpoint. Returns the last exit status."""
    for attempt in range(max_restarts + 1):
        env = {**os.environ, RESTART_COUNT_VAR: str(attempt)}
        status = subprocess.run(list(argv), env=env).returncode
        if status in AGREED_EXIT_STATUSES or attempt == max_restarts:
            return ExitStatus.of_returncode(status)
        log.warning("the ranks failed (exit %d): restart %d of %d, resuming from the newest checkpoint",
                    status, attempt + 1, max_restarts)
    return status


def rank_command(command: Sequence[str]) -> list[str]:
    """Every rank runs a foreign command through ``ddp-hpc run`` (torchrun's variables under
    any launcher); ddp-hpc's own verbs resolve their rank by themselves."""
    own = Path(command[0]).name == "ddp-hpc" or list(command[1:3]) == ["-m", "ddp_hpc"]
    return list(command) if own else ["ddp-hpc", "run", "--", *command]


def build_local_command(launch: LocalLaunch) -> list[str]:
    command = rank_command(launch.command)
    if launch.launcher == "torchrun":
        return build_torchrun(launch.nproc, command, launch.max_restarts)
    return build_mpiexec(MpiLaunch(launch.launcher, nodes=1, ranks_per_node=launch.nproc,
                                   command=command, oversubscribe=True,
                                   allow_root=os.geteuid() == 0))

"""``ddp-hpc launch --node-supervisor``: one node's supervisor of a recovering launch, the task
an outer launch's mpiexec or srun starts once per node (launch/node.py). Not a ``--launcher``
choice: the flag chooses it, whatever ``--launcher`` says. Its ranks are ``LocalRanks`` in the
node's place, recovered by a ``Recoverer`` that is a client of the outer launch's store; it
never restarts (its launch does), and a stop comes through that store."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ddp_hpc.contract import RECOVERY_STORE_VAR, RESTART_COUNT_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import Attempts
from ddp_hpc.launch.launchers.base import Launcher, Plan
from ddp_hpc.launch.local import LocalRanks, rank_command
from ddp_hpc.launch.node import node_place, rank_base_environment
from ddp_hpc.launch.recovering import Recoverer
from ddp_hpc.launch.restart import LaunchEnd

if TYPE_CHECKING:
    from ddp_hpc.launch.spec import LaunchSpec


@dataclass(frozen=True)
class NodeSupervisor(Launcher):
    name: ClassVar[str] = "node-supervisor"

    def check(self, spec: LaunchSpec) -> None:
        if not spec.store_address:
            raise UserError(f"--node-supervisor runs under `ddp-hpc launch --recover N --launcher "
                            f"mpich|openmpi|srun`, which serves the recovery store: ${RECOVERY_STORE_VAR} is "
                            "not set")

    def starts_node_supervisors(self, spec: LaunchSpec) -> bool:
        return True  # the stop comes through the store, as it came

    def plan(self, spec: LaunchSpec, folder: Path | None) -> Plan:
        environ, address, limits = os.environ, spec.store_address, spec.recovery
        node_rank, nodes = node_place(environ)
        ranks = LocalRanks(spec.nproc, rank_command(spec.command), base_env=rank_base_environment(environ),
                           node_rank=node_rank, num_nodes=nodes, master_addr=address.rpartition(":")[0])
        assert limits is not None
        recoverer = Recoverer(ranks, limits, store_address=address,
                              outer_attempt=int(environ.get(RESTART_COUNT_VAR, "0") or 0))
        return Plan(recoverer, recoverer, LaunchEnd())

    def keeps_snapshot_folder(self, spec: LaunchSpec) -> bool:
        return False  # its ranks use its launch's

    def restarts(self, spec: LaunchSpec) -> int:
        return 0  # the outer launch's

    def attach(self, plan: Plan, supervisor: Any) -> None:
        if plan.in_job is not None:
            plan.in_job.on_stop = supervisor.request_stop  # a stop the outer launch asked for through the store

    def describe(self, spec: LaunchSpec, attempts: Attempts) -> str:
        return attempts.describe()

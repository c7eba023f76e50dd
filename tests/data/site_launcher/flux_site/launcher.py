"""``ddp-hpc launch --launcher flux``: the ranks on this machine, as ``--launcher local`` starts
them, each with Flux's task variables instead of torchrun's."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import ClassVar

from ddp_hpc.launch.launchers.local import LocalLauncher
from ddp_hpc.launch.local import LocalRanks, rank_command

#: What ``LocalRanks`` gives a rank besides MASTER_ADDR/MASTER_PORT, which Flux's tasks do not see.
TORCHRUN_ONLY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


@dataclass(frozen=True)
class FluxRanks(LocalRanks):
    def environment(self, local_rank: int, attempt: int, port: int, run_id: str) -> dict[str, str]:
        env = super().environment(local_rank, attempt, port, run_id)
        for name in TORCHRUN_ONLY:
            env.pop(name, None)
        env.update(FLUX_TASK_RANK=str(self.node_rank * self.nproc + local_rank), FLUX_TASK_LOCAL_ID=str(local_rank),
                   FLUX_JOB_SIZE=str(self.world_size), FLUX_JOB_NNODES=str(self.num_nodes), FLUX_JOB_ID=run_id)
        return env

    def describe(self) -> str:
        return (f"# flux run: {self.nproc} tasks, each with Flux's variables (FLUX_TASK_RANK, FLUX_JOB_SIZE, ...)\n"
                f"{shlex.join(self.command)}\n")


@dataclass(frozen=True)
class FluxLauncher(LocalLauncher):
    name: ClassVar[str] = "flux"
    old_names: ClassVar[tuple[str, ...]] = ()

    def ranks(self, spec) -> LocalRanks:
        return FluxRanks(spec.nproc, rank_command(spec.command))

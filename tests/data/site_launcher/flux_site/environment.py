"""The rank side of ``--launcher flux``: where a task sits, from Flux's variables."""

from __future__ import annotations

from ddp_hpc.environment.base import ClusterEnvironment, Env, RankInfo, read_int


class FluxEnvironment(ClusterEnvironment):
    name = "flux"
    variables = ("FLUX_TASK_RANK", "FLUX_JOB_SIZE", "FLUX_TASK_LOCAL_ID", "FLUX_JOB_NNODES", "FLUX_JOB_ID")
    launch_variables = ("FLUX_JOB_ID",)

    def detect(self, env: Env) -> bool:
        return "FLUX_TASK_RANK" in env

    def ranks(self, env: Env) -> RankInfo:
        rank = read_int(env, "FLUX_TASK_RANK")
        world_size = read_int(env, "FLUX_JOB_SIZE", minimum=1)
        nodes = read_int(env, "FLUX_JOB_NNODES", minimum=1)
        per_node = -(-world_size // nodes)
        return RankInfo(rank, world_size, read_int(env, "FLUX_TASK_LOCAL_ID"), per_node, rank // per_node, nodes)

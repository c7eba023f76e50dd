"""Resolve this process's ``DistEnv`` from whatever launcher started it."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence

from ddp_hpc.contract import HOST_SUFFIX_VAR
from ddp_hpc.environment.base import ClusterEnvironment, DistEnv, Env, RankInfo, check_rank_info
from ddp_hpc.environment.launchers import LAUNCHERS, site_launchers
from ddp_hpc.environment.ports import PortRange, derive_port, free_port, parse_port
from ddp_hpc.errors import EnvironmentConflictError, UserError

log = logging.getLogger(__name__)


def detect_launcher(env: Env, launchers: Sequence[ClusterEnvironment] | None = None) -> ClusterEnvironment:
    """The first launcher, in the documented order, whose variables are present; by default
    (``launchers`` None) a site's (``site_launchers``) before the generic ``env`` and ``single``,
    whose entry points are read only then."""
    chosen = next(launcher for launcher in launchers or LAUNCHERS if launcher.detect(env))
    if launchers is None and chosen.generic:
        return next((site for site in site_launchers() if site.detect(env)), chosen)
    return chosen


def _describe(launcher: ClusterEnvironment, info: RankInfo) -> str:
    return f"{launcher.name} says rank {info.rank} of {info.world_size}"


def _compared_with(chosen: ClusterEnvironment, env: Env,
                   launchers: Sequence[ClusterEnvironment]) -> list[ClusterEnvironment]:
    """The other launchers whose variables must agree with the chosen one.

    torchrun's workers are compared with nothing: torchrun is legitimately nested in
    srun or mpiexec, whose variables then describe the agents. Under an MPI launcher the
    SLURM variables are the allocation's (mpiexec inside sbatch inherits them, one value
    for every rank) and are not compared either.
    """
    if not chosen.checked_against_others:
        return []
    others = [launcher for launcher in launchers
              if launcher is not chosen and launcher.checked_against_others and launcher.detect(env)]
    if chosen.mpi:
        others = [launcher for launcher in others if not launcher.allocation_wide]
    return others


def _check_agreement(chosen: ClusterEnvironment, info: RankInfo, env: Env,
                     launchers: Sequence[ClusterEnvironment]) -> None:
    for other in _compared_with(chosen, env, launchers):
        other_info = other.ranks(env)
        if (other_info.rank, other_info.world_size) != (info.rank, info.world_size):
            raise EnvironmentConflictError(
                f"launcher variables disagree: {_describe(chosen, info)} "
                f"({', '.join(v for v in chosen.variables[:2])}), but "
                f"{_describe(other, other_info)} ({', '.join(v for v in other.variables[:2])}); "
                f"unset the stale ones")


def resolve_master_port(env: Env, launcher: ClusterEnvironment, info: RankInfo,
                        port_range: PortRange) -> int:
    """MASTER_PORT, else derived from the job id and launch, else agreed on one node."""
    if env.get("MASTER_PORT", "").strip():
        return parse_port(env["MASTER_PORT"])
    key = launcher.launch_id(env)
    if key:
        return derive_port(key, port_range)
    if info.world_size == 1:
        return free_port()
    if info.num_nodes == 1:
        # Every local rank of one launch is a child of the same launcher proxy.
        return derive_port(f"ppid{os.getppid()}", port_range)
    raise UserError(f"{launcher.name} launch across {info.num_nodes} nodes without a job id: "
                    "export MASTER_PORT so every rank agrees on a port")


def resolve_env(env: Env | None = None, *, host_suffix: str | None = None,
                port_range: PortRange = PortRange(),
                launchers: Sequence[ClusterEnvironment] | None = None) -> DistEnv:
    """Who this process is in the job, from the environment alone (no process group).

    Raises ``UserError`` for variables that are malformed or that disagree.
    """
    env = os.environ if env is None else env
    suffix = env.get(HOST_SUFFIX_VAR, "") if host_suffix is None else host_suffix
    launcher = detect_launcher(env, launchers)
    info = check_rank_info(launcher.ranks(env), launcher.name)
    _check_agreement(launcher, info, env, launchers or LAUNCHERS)
    resolved = DistEnv(
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        num_nodes=info.num_nodes,
        master_addr=launcher.main_address(env, info.num_nodes, suffix),
        master_port=resolve_master_port(env, launcher, info, port_range),
        source=launcher.name,
    )
    log.debug("resolved %s on %s", resolved, socket.gethostname())
    return resolved

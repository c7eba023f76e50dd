"""One class per launcher: which variables mark it, and what they say.

Variable sets were recorded from real launches on Debian (torchrun 2.13, Open MPI 4.1,
MPICH/Hydra 4.0, SLURM 22.05) and taken from the documentation of Cray PALS, Intel MPI
and MVAPICH2; ``tests/test_environment.py`` replays them.

A site's launcher whose tasks carry variables of their own adds its class through the
``ddp_hpc.environments`` entry points (``site_launchers``), the rank side of a
``ddp_hpc.launchers`` entry point (docs/architecture.md).
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache

from ddp_hpc.environment.base import (
    AbortRequest,
    ClusterEnvironment,
    Env,
    RankInfo,
    first_int,
    node_layout,
    read_int,
    read_optional_int,
)
from ddp_hpc.environment.site_entries import site_objects
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)


class TorchrunEnvironment(ClusterEnvironment):
    """torchrun / torch.distributed.elastic: ``TORCHELASTIC_RUN_ID`` marks its workers.

    It is tried first because torchrun is often started *by* another launcher (one
    torchrun per node under srun or mpiexec): then the outer launcher's variables
    describe the torchrun agents, not the training ranks, and are not compared.
    """

    name = "torchrun"
    checked_against_others = False
    variables = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
    launch_variables = ("TORCHELASTIC_RUN_ID",)

    def detect(self, env: Env) -> bool:
        return bool(env.get("TORCHELASTIC_RUN_ID"))

    def ranks(self, env: Env) -> RankInfo:
        world_size = read_int(env, "WORLD_SIZE", minimum=1)
        local_world_size = read_int(env, "LOCAL_WORLD_SIZE", minimum=1)
        node_rank = read_int(env, "GROUP_RANK")
        num_nodes = read_optional_int(env, "GROUP_WORLD_SIZE", minimum=1)
        return RankInfo(
            rank=read_int(env, "RANK"),
            world_size=world_size,
            local_rank=read_int(env, "LOCAL_RANK"),
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=num_nodes or -(-world_size // local_world_size),
        )



class _CommWorldEnvironment(ClusterEnvironment):
    """An MPI whose tasks see ``<PREFIX>RANK``, ``SIZE``, ``LOCAL_RANK`` and ``LOCAL_SIZE``
    (Open MPI's ``OMPI_COMM_WORLD_``, MVAPICH's ``MV2_COMM_WORLD_``); the node rank comes from
    the block layout."""

    mpi = True
    prefix = ""

    def detect(self, env: Env) -> bool:
        return f"{self.prefix}RANK" in env

    def ranks(self, env: Env) -> RankInfo:
        rank = read_int(env, f"{self.prefix}RANK")
        world_size = read_int(env, f"{self.prefix}SIZE", minimum=1)
        local_world_size = read_int(env, f"{self.prefix}LOCAL_SIZE", minimum=1)
        node_rank, num_nodes = node_layout(rank, world_size, local_world_size)
        return RankInfo(rank, world_size, read_int(env, f"{self.prefix}LOCAL_RANK"),
                        local_world_size, node_rank, num_nodes)


class OpenMPIEnvironment(_CommWorldEnvironment):
    """Open MPI's ``mpirun``/``mpiexec`` (and prterun).

    ``OMPI_COMM_WORLD_NODE_RANK`` is *not* a node index (it counts processes on the node
    across all jobs), so the node rank comes from the block layout.
    """

    name = "openmpi"
    prefix = "OMPI_COMM_WORLD_"
    variables = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_NAMESPACE")
    launch_variables = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")


class PalsEnvironment(ClusterEnvironment):
    """Cray PALS ``mpiexec`` (Aurora, Polaris, Sunspot): ``PALS_*`` with Cray PMI's sizes.

    PALS also exports ``PMI_RANK``, so it must be tried before MPICH/Hydra.
    """

    name = "pals"
    mpi = True
    variables = ("PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_NODEID", "PALS_LOCAL_SIZE",
                 "PMIX_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE", "PALS_APID")
    launch_variables = ("PALS_APID",)

    def detect(self, env: Env) -> bool:
        return "PALS_RANKID" in env

    def ranks(self, env: Env) -> RankInfo:
        rank = read_int(env, "PALS_RANKID")
        world_size = first_int(env, "PMI_SIZE", "PALS_SIZE", "WORLD_SIZE", minimum=1)
        if world_size is None:
            raise UserError("Cray PALS launch without PMI_SIZE: use mpiexec with --pmi=pmix "
                            "or cray-pmi, or export WORLD_SIZE")
        local_rank = first_int(env, "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK")
        local_world_size = first_int(env, "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", minimum=1)
        if local_rank is None or local_world_size is None:
            raise UserError("Cray PALS launch without PALS_LOCAL_RANKID/PMI_LOCAL_SIZE")
        node_rank, num_nodes = node_layout(rank, world_size, local_world_size)
        node_id = read_optional_int(env, "PALS_NODEID")
        return RankInfo(rank, world_size, local_rank, local_world_size,
                        node_rank if node_id is None else node_id, num_nodes)



class MvapichEnvironment(_CommWorldEnvironment):
    """MVAPICH2 (``mpirun_rsh`` or its Hydra). Tried before plain Hydra: its names are its own."""

    name = "mvapich"
    prefix = "MV2_COMM_WORLD_"
    variables = ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                 "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")


class HydraEnvironment(ClusterEnvironment):
    """MPICH's Hydra ``mpiexec`` and Intel MPI (also Hydra): ``PMI_*`` plus ``MPI_LOCAL*``.

    ``MPI_LOCALRANKID`` is required: srun's PMI plugins export ``PMI_RANK`` too, but not
    it, and those launches belong to the SLURM class.
    """

    name = "mpich"
    mpi = True
    variables = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")

    def detect(self, env: Env) -> bool:
        return "PMI_RANK" in env and "MPI_LOCALRANKID" in env

    def ranks(self, env: Env) -> RankInfo:
        rank = read_int(env, "PMI_RANK")
        world_size = read_int(env, "PMI_SIZE", minimum=1)
        local_world_size = read_int(env, "MPI_LOCALNRANKS", minimum=1)
        node_rank, num_nodes = node_layout(rank, world_size, local_world_size)
        return RankInfo(rank, world_size, read_int(env, "MPI_LOCALRANKID"),
                        local_world_size, node_rank, num_nodes)

    def abort_request(self, env: Env) -> AbortRequest | None:
        """Hydra waits for the other ranks after a plain non-zero exit (measured: until the
        collective timeout), but ends the job at once on PMI-1's ``cmd=abort``, which
        ``MPI_Abort`` sends over ``PMI_FD``."""
        fd = env.get("PMI_FD", "").strip()
        return ("pmi", fd) if fd.isdigit() else None


_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = _TASKS_PER_NODE.match(part.strip())
        if not match:
            raise UserError(f"cannot parse SLURM tasks-per-node list {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


class SlurmEnvironment(ClusterEnvironment):
    """Tasks of a SLURM job step (``srun``, and submitit, which uses srun).

    An sbatch script's shell carries ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``
    but no ``SLURM_STEP_ID``: a process there is a single process, not rank 0 of N, so
    the step variables are what mark a task.
    """

    name = "slurm"
    allocation_wide = True
    variables = ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
                 "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NUM_NODES",
                 "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
    launch_variables = ("SLURM_STEP_ID", "SLURM_STEPID")

    def detect(self, env: Env) -> bool:
        return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)

    def ranks(self, env: Env) -> RankInfo:
        world_size = first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", minimum=1)
        num_nodes = first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", minimum=1)
        if world_size is None or num_nodes is None:
            raise UserError("SLURM step without SLURM_STEP_NUM_TASKS/SLURM_STEP_NUM_NODES")
        node_rank = read_int(env, "SLURM_NODEID")
        per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if per_node_spec:
            per_node = expand_tasks_per_node(per_node_spec)
            local_world_size = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
        else:
            local_world_size = -(-world_size // num_nodes)
        return RankInfo(read_int(env, "SLURM_PROCID"), world_size, read_int(env, "SLURM_LOCALID"),
                        local_world_size, node_rank, num_nodes)

    def job_key(self, env: Env) -> str | None:
        step = super().job_key(env)
        return f"step{step}" if step else None

    def abort_request(self, env: Env) -> AbortRequest | None:
        """Plain srun waits for the other tasks after one exits non-zero: end this job step
        (only this one) with ``scancel --ctld --signal=KILL JOB.STEP``.

        ``--ctld`` because the caller is a task of that step: without it scancel sends the
        kill to each node's slurmd itself, and the node that kills scancel's own task first
        can end scancel before the other nodes hear of it (measured on the test cluster:
        a task outlived the request in 5 of 40 steps; through slurmctld in 0 of 40)."""
        job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
        return (("command", ["scancel", "--ctld", "--quiet", "--signal=KILL", f"{job}.{step}"])
                if job and step else None)


class EnvVarsEnvironment(ClusterEnvironment):
    """torch's ``env://`` variables set by hand or by a wrapper script, without torchrun."""

    name = "env"
    generic = True
    variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")

    def detect(self, env: Env) -> bool:
        return "RANK" in env

    def ranks(self, env: Env) -> RankInfo:
        rank = read_int(env, "RANK")
        world_size = read_int(env, "WORLD_SIZE", minimum=1)
        local_world_size = first_int(env, "LOCAL_WORLD_SIZE", minimum=1) or world_size
        local_rank = first_int(env, "LOCAL_RANK")
        default_node_rank, num_nodes = node_layout(rank, world_size, local_world_size)
        node_rank = first_int(env, "GROUP_RANK", "NODE_RANK")
        return RankInfo(rank, world_size,
                        rank % local_world_size if local_rank is None else local_rank,
                        local_world_size,
                        default_node_rank if node_rank is None else node_rank, num_nodes)


class SingleProcessEnvironment(ClusterEnvironment):
    """Nothing launched us: one process, rank 0 of 1."""

    name = "single"
    generic = True
    checked_against_others = False

    def detect(self, env: Env) -> bool:
        return True

    def ranks(self, env: Env) -> RankInfo:
        return RankInfo(0, 1, 0, 1, 0, 1)


#: The fixed detection order (docs/environment.md explains it).
LAUNCHERS: tuple[ClusterEnvironment, ...] = (
    TorchrunEnvironment(),
    OpenMPIEnvironment(),
    PalsEnvironment(),
    MvapichEnvironment(),
    HydraEnvironment(),
    SlurmEnvironment(),
    EnvVarsEnvironment(),
    SingleProcessEnvironment(),
)

SITE_LAUNCHERS_GROUP = "ddp_hpc.environments"


@lru_cache(maxsize=1)
def site_launchers() -> tuple[ClusterEnvironment, ...]:
    """The ``ClusterEnvironment`` classes other packages register in the
    ``ddp_hpc.environments`` entry points (one that cannot be loaded is left out, with a warning)."""
    return site_objects(SITE_LAUNCHERS_GROUP, ClusterEnvironment)


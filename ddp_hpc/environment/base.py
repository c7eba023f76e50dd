"""The resolved rank environment and the interface every launcher class implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ddp_hpc.environment.hosts import with_suffix
from ddp_hpc.environment.jobs import current_job, jobs_asked
from ddp_hpc.errors import UserError

Env = Mapping[str, str]

def scheduler_job_id(env: Env) -> tuple[str, str] | None:
    """``(variable, job id)`` of the scheduler job this process runs in (``jobs.current_job``), or None."""
    found = current_job(env)
    return (found[1], found[2]) if found else None


#: How a launcher can be asked to end every rank: ``("pmi", fd)`` or ``("command", argv)``.
AbortRequest = tuple[str, "str | list[str]"]


@dataclass(frozen=True)
class RankInfo:
    """What one launcher's variables say about this process, before master address and port."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int


@dataclass(frozen=True)
class DistEnv(RankInfo):
    """Where this process sits in the job (``RankInfo``'s fields) and how to reach rank 0."""

    master_addr: str
    master_port: int
    source: str

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ClusterEnvironment(ABC):
    """One launcher's variables: ``detect`` says whether they are here, ``ranks`` reads them.

    It also answers, for everything else to ask: the job this launch belongs to
    (``job_id``, ``job_key``, ``launch_id``, ``identity``), where rank 0 runs
    (``main_address``) and how to end every rank when one fails (``abort_request``).
    """

    #: Short name shown as ``DistEnv.source``.
    name: str = ""
    #: The variables this launcher sets, in the order they are documented.
    variables: tuple[str, ...] = ()
    #: Variables naming one launch of this launcher within a job, first found wins.
    launch_variables: tuple[str, ...] = ()
    #: A fallback (``env``, ``single``): a site's launchers (``site_launchers``) are tried before it.
    generic: bool = False
    #: Whether the other launchers' variables present must agree with this one's. Not for
    #: torchrun's workers (torchrun is legitimately nested in srun or mpiexec, whose variables
    #: then describe the agents) nor for a single process.
    checked_against_others: bool = True
    #: An MPI launcher (mpiexec of any MPI): under it a scheduler's allocation-wide variables
    #: (``allocation_wide``) are inherited, one value for every rank, and not compared.
    mpi: bool = False
    #: This launcher's variables may be the allocation's, inherited by an MPI launch inside it (SLURM's).
    allocation_wide: bool = False

    @abstractmethod
    def detect(self, env: Env) -> bool:
        """True when this launcher started the current process."""

    @abstractmethod
    def ranks(self, env: Env) -> RankInfo:
        """Rank, sizes and node position from this launcher's variables."""

    def job_id(self, env: Env) -> str | None:
        """The scheduler's job id of the allocation (``jobs.current_job``), or None."""
        found = scheduler_job_id(env)
        return found[1] if found else None

    def _launch_variable(self, env: Env) -> tuple[str, str] | None:
        for name in self.launch_variables:
            value = env.get(name, "").strip()
            if value:
                return name, value
        return None

    def job_key(self, env: Env) -> str | None:
        """A string every rank of one launch shares (within the job); None if unknown."""
        found = self._launch_variable(env)
        return found[1] if found else None

    def launch_id(self, env: Env) -> str | None:
        """Job id and launch together (``41|step0``): derives the port and torchrun's run
        id, the same on every rank of this launch; None where neither is known."""
        parts = [part for part in (self.job_id(env), self.job_key(env)) if part]
        return "|".join(parts) if parts else None

    def identity(self, env: Env) -> dict[str, str]:
        """The variables that name this job and launch (the rendezvous marker shows them)."""
        return dict(found for found in (scheduler_job_id(env), self._launch_variable(env)) if found)

    def main_address(self, env: Env, num_nodes: int, host_suffix: str = "") -> str:
        """Rank 0's host: MASTER_ADDR, the first host of the scheduler job's nodes (the SLURM
        node list, the PBS node file, a site's job: ``jobs.SchedulerJob.hosts``), or loopback."""
        if env.get("MASTER_ADDR", "").strip():
            return env["MASTER_ADDR"].strip()
        for job in jobs_asked(env):  # a malformed list: its UserError
            hosts = job.hosts(env)
            if hosts:
                return with_suffix(hosts[0], host_suffix)
        if num_nodes == 1:
            return "127.0.0.1"
        raise UserError(f"ranks span {num_nodes} nodes but nothing says where rank 0 runs: "
                        "export MASTER_ADDR, or run under SLURM or PBS")

    def abort_request(self, env: Env) -> AbortRequest | None:
        """How to make this launcher end every rank after one failed, or None where it does
        so by itself (torchrun, Open MPI's mpiexec, ``srun --kill-on-bad-exit``)."""
        return None


def read_int(env: Env, name: str, *, minimum: int = 0) -> int:
    """The integer value of ``env[name]``, or a UserError naming the variable."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise UserError(f"environment variable {name} is not set")
    try:
        value = int(raw.strip())
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise UserError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def read_optional_int(env: Env, name: str, *, minimum: int = 0) -> int | None:
    if not env.get(name, "").strip():
        return None
    return read_int(env, name, minimum=minimum)


def first_int(env: Env, *names: str, minimum: int = 0) -> int | None:
    """The first of ``names`` that is set, as an integer."""
    for name in names:
        value = read_optional_int(env, name, minimum=minimum)
        if value is not None:
            return value
    return None


def node_layout(rank: int, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(node_rank, num_nodes) for a block layout: ranks fill one node before the next.

    Used for launchers that do not export a node index (MPICH/Hydra, MVAPICH); it is exact
    for ``-ppn P`` block placement, the default of every mpiexec this toolkit renders.
    """
    per_node = max(local_world_size, 1)
    return rank // per_node, -(-world_size // per_node)


def check_rank_info(info: RankInfo, source: str) -> RankInfo:
    """Refuse values no launcher would produce, naming the launcher."""
    problems = []
    if info.world_size < 1:
        problems.append(f"world size {info.world_size} < 1")
    if not 0 <= info.rank < info.world_size:
        problems.append(f"rank {info.rank} outside [0, {info.world_size})")
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        problems.append(f"local rank {info.local_rank} outside [0, {info.local_world_size})")
    if info.local_world_size > info.world_size:
        problems.append(f"local world size {info.local_world_size} > world size {info.world_size}")
    if not 0 <= info.node_rank < max(info.num_nodes, 1):
        problems.append(f"node rank {info.node_rank} outside [0, {info.num_nodes})")
    if problems:
        raise UserError(f"{source} variables are inconsistent: " + "; ".join(problems))
    return info

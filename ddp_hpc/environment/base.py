"""The resolved rank environment and the interface every launcher class implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ddp_hpc.errors import UserError

Env = Mapping[str, str]


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
class DistEnv:
    """Where this process sits in the job and how to reach rank 0."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
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
    """One launcher's variables: ``detect`` says whether they are here, ``ranks`` reads them."""

    #: Short name shown as ``DistEnv.source``.
    name: str = ""
    #: The variables this launcher sets, in the order they are documented.
    variables: tuple[str, ...] = ()

    @abstractmethod
    def detect(self, env: Env) -> bool:
        """True when this launcher started the current process."""

    @abstractmethod
    def ranks(self, env: Env) -> RankInfo:
        """Rank, sizes and node position from this launcher's variables."""

    def job_key(self, env: Env) -> str | None:
        """A string every rank of one launch shares, used to derive a port; None if unknown."""
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

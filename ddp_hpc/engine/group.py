"""The few collectives the engine's parts need, on whatever process group is running.

The Trainer hands its ``DistContext``; a user's own loop hands nothing and gets a
``ProcessGroupView`` of the group ``torch.distributed.init_process_group`` started (or
of one process, when no group exists), with the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class Collectives(Protocol):
    """What ``DistContext`` and ``ProcessGroupView`` both offer."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_rank_zero(self) -> bool: ...

    @property
    def group_initialized(self) -> bool: ...

    def barrier(self) -> None: ...

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]: ...

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None: ...


@dataclass(frozen=True)
class ProcessGroupView:
    """The default process group as it is now (or one process without a group)."""

    rank: int
    world_size: int
    group_initialized: bool
    device: torch.device

    @classmethod
    def current(cls) -> ProcessGroupView:
        if not (dist.is_available() and dist.is_initialized()):
            return cls(0, 1, False, torch.device("cpu"))
        backend = str(dist.get_backend()).lower()
        device = torch.device("cpu")
        if "nccl" in backend and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        elif "xccl" in backend and hasattr(torch, "xpu") and torch.xpu.is_available():
            device = torch.device("xpu", torch.xpu.current_device())
        return cls(dist.get_rank(), dist.get_world_size(), True, device)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.group_initialized:
            dist.barrier()

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.group_initialized:
            dist.all_reduce(tensor, op=ops[op])
        return tensor.cpu().tolist()

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None:
        if not self.group_initialized:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

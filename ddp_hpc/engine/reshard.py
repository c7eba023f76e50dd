"""Resume on another world size (or per-rank batch): re-shard the rest of the epoch.

An epoch's sample order depends only on (seed, epoch). With W ranks of batch b, rank r
takes positions r, r + W, r + 2W, ... of that order, so after k micro-batches on every
rank the ranks together have trained exactly the first k * b * W positions: a prefix
(mid-epoch stops fall on step boundaries, where every batch so far was full). That
prefix length is the epoch's *position*, and it does not depend on the world size. A
job resumed on W' ranks continues the epoch from that position, dealing the rest of the
order out over its W' ranks; the next epoch starts whole again.

Only the sample accounting carries over exactly. The global batch, and so the training
trajectory, changes with the effective batch size; the run says so in its log.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sharding:
    """How an epoch is dealt out: ranks, micro-batch per rank, micro-batches per step."""

    world_size: int
    batch_size: int
    grad_accum_steps: int

    @property
    def effective_batch_size(self) -> int:
        return self.world_size * self.batch_size * self.grad_accum_steps

    @classmethod
    def of_checkpoint(cls, state: Mapping[str, Any]) -> Sharding:
        training = state["config"]["training"]
        return cls(int(state["world_size"]), int(training["batch_size"]), int(training["grad_accum_steps"]))


@dataclass(frozen=True)
class Resharding:
    """A checkpoint of ``old`` continued by ``new``: the epoch in progress, and how far in."""

    old: Sharding
    new: Sharding
    epoch: int
    global_step: int
    #: Positions of the epoch's order trained before the checkpoint (all ranks together).
    position: int


def plan_resharding(progress: Mapping[str, int], old: Sharding, new: Sharding) -> Resharding | None:
    """None where nothing changed (the exact, bit-identical resume applies)."""
    if old == new:
        return None
    position = int(progress.get("epoch_offset", 0)) + int(progress["batches_done"]) * old.batch_size * old.world_size
    return Resharding(old, new, int(progress["epoch"]), int(progress["global_step"]), position)


def epoch_order(dataset_len: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's sample order, as torch's DistributedSampler draws it."""
    if not shuffle:
        return list(range(dataset_len))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=generator).tolist()


def shard_rest(order: list[int], position: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s share of ``order[position:]``, padded like DistributedSampler so that
    every rank gets the same number of samples (the first few of the rest repeat)."""
    rest = order[position:]
    per_rank = math.ceil(len(rest) / world_size)
    padding = per_rank * world_size - len(rest)
    if padding:
        rest += (rest * math.ceil(padding / len(rest)))[:padding]
    return rest[rank::world_size]


def steps_left(samples_per_rank: int, sharding: Sharding, drop_last: bool) -> int:
    """Optimizer steps an epoch (or its rest) of ``samples_per_rank`` takes."""
    full, rest = divmod(samples_per_rank, sharding.batch_size)
    batches = full if drop_last or rest == 0 else full + 1
    return math.ceil(batches / sharding.grad_accum_steps)


def lr_factor(resharding: Resharding, lr_scaling: str) -> float:
    """What the learning rate is multiplied by: the change of the effective batch under
    ``lr_scaling: linear``, else 1."""
    if lr_scaling != "linear":
        return 1.0
    return resharding.new.effective_batch_size / resharding.old.effective_batch_size


def rescale_lr(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply the restored learning rates (current, initial and the schedule's base) by ``factor``."""
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if scheduler is not None:
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

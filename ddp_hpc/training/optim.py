"""Optimizer, learning-rate schedule and LR scaling from the training config."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ddp_hpc.config import SchedulerConfig, TrainingConfig

log = logging.getLogger(__name__)

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
}


def scaled_lr(training: TrainingConfig, world_size: int) -> float:
    """The LR to use: scaled linearly with the effective batch when asked to."""
    if training.lr_scaling == "none":
        return training.lr
    effective = training.batch_size * world_size * training.grad_accum_steps
    return training.lr * effective / training.base_batch_size


def build_optimizer(parameters: Iterable[torch.nn.Parameter], training: TrainingConfig, lr: float,
                    shard_state: bool) -> torch.optim.Optimizer:
    cls = _OPTIMIZERS[training.optimizer]
    kwargs: dict = {"lr": lr, "weight_decay": training.weight_decay}
    if training.optimizer == "sgd":
        kwargs["momentum"] = training.momentum
    if shard_state:
        # Imported here: torch.distributed.optim pulls in FSDP and DTensor (~0.8 s at start-up).
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(parameters), optimizer_class=cls, **kwargs)
    return cls(parameters, **kwargs)


def _cosine(warmup: int, total: Callable[[], int], floor: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total() - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig,
                    total_intervals: int | Callable[[], int]) -> LRScheduler | None:
    """The schedule over ``total_intervals`` steps or epochs (config.interval), or None.
    A callable is asked each time: a run resumed on another world size learns its length
    only from the checkpoint, which is loaded into the schedule built before."""
    if config.name == "none":
        return None
    if config.name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.step_size, gamma=config.gamma)
    total = total_intervals if callable(total_intervals) else (lambda: total_intervals)
    return LambdaLR(optimizer, _cosine(config.warmup, total, config.min_lr_ratio))

"""What ``InJobRecovery.run`` refuses before the first step, the same on every rank (one
line, exit 2, no recovery spent): a model or loop it cannot keep exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.engine import sharding
from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer



def run_refusal(model: nn.Module, checkpointer: Checkpointer | None, *, shrinks: bool = False) -> str | None:
    """Why ``InJobRecovery.run`` cannot take ``model`` (one line), or None."""
    if is_sharded(model) and shrinks:
        return ("an FSDP2 model cannot go on with fewer ranks (--shrink): its shards are laid out over every rank; "
                "launch with --recover alone (a lost rank is replaced, its shards taken from a buddy's snapshot)")
    if isinstance(model, DistributedDataParallel):
        return "InJobRecovery.run takes the model itself: it wraps it in DDP for each group"
    if checkpointer is not None and any(isinstance(obj, DistributedDataParallel)
                                        for obj in checkpointer.objects.values()):
        return ("InJobRecovery.run: give the Checkpointer the model itself, not its DDP wrapper (each group gets "
                "a wrapper of its own)")
    return None


def schedule_refusal(optimizer: torch.optim.Optimizer, checkpointer: Checkpointer | None) -> str | None:
    """Why an LR scheduler of ``optimizer`` cannot go on exact under ``--recover`` (one line),
    or None: one built before ``run`` (torch marks the optimizer's ``step`` when a scheduler
    is built on it) that is not among the Checkpointer's objects does not travel, so a
    replacement's would start over and a survivor's would not follow the group back: the
    ranks' learning rates part without a word. One built inside ``train`` is not yet there."""
    if not getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        return None
    held = checkpointer.objects.values() if checkpointer is not None else ()
    if any(isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and obj.optimizer is optimizer for obj in held):
        return None
    return ("InJobRecovery.run: an LR scheduler was built on the optimizer and is not among the Checkpointer's "
            "objects: it would not travel to a replacement, and the ranks' learning rates would part after a "
            "recovery; put it among the objects, or build it inside train from recovery.step (docs/api.md, "
            "in-job recovery)")


def sharded_run_refusal(model: nn.Module, optimizer: torch.optim.Optimizer,
                        wrap: Callable[[nn.Module], Any] | None) -> str | None:
    """Why ``InJobRecovery.run`` cannot train a sharded (FSDP2) ``model`` (one line), or
    None: the same mistake on every rank, found before anything is wrapped or trained."""
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    if not is_sharded(bare):
        return None
    if bare is not model or wrap is not None:
        return ("InJobRecovery.run: a sharded (FSDP2) model is its own wrapper: give run the model itself, with no "
                "DDP around it and no wrap (DDP cannot take FSDP2's sharded parameters)")
    return sharding.model_refusal(model) or sharding.optimizer_refusal([model], optimizer)


def group_refusal() -> str | None:
    """Why ``InJobRecovery`` cannot start this rank's group (one line), or None: a default
    group started before it (``dist.init_process_group``, or ``fully_shard`` or
    ``init_device_mesh``, which start one where none exists) is not one it can replace."""
    if not dist.is_initialized():
        return None
    return ("InJobRecovery started after a process group already existed (dist.init_process_group, or fully_shard "
            "/ init_device_mesh, which start one): construct InJobRecovery first, in place of "
            "init_process_group, then build and shard the model")


def is_sharded(model: nn.Module) -> bool:
    """``model`` or a module in it is sharded by FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has it only where fully_shard was born
        from torch.distributed._composable.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules())

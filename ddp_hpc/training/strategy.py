"""``training.strategy``: how the model is spread over the ranks (DDP replicas or FSDP2
shards), and the model and optimizer state a checkpoint holds under each.

Under ``fsdp2`` the model is sharded in place by ``fully_shard``: the module the Trainer
built is the one it trains, its parameters are DTensors of which each rank holds one
slice, and the optimizer built on them keeps state for that slice only. A checkpoint in
the single-file format holds the whole (unsharded) state, gathered to rank 0, so it loads
on any world size and into a plain model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.config import Config, FsdpConfig
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.startup.distributed import DistContext
from ddp_hpc.engine.sharding import load_whole_optimizer, whole_model_state, whole_optimizer_state
from ddp_hpc.errors import UserError
from ddp_hpc.torch_support import fsdp2_refusal, installed

log = logging.getLogger(__name__)


def check_supported(config: Config) -> None:
    """Refuse, in one line, a ``training.strategy`` the installed torch cannot run: part of
    the config check on each rank (the login node that submits may have another torch)."""
    refusal = fsdp2_refusal(installed()) if config.training.strategy == "fsdp2" else None
    if refusal:
        raise ConfigError(refusal)


def recovery_refusal(config: Config, *, shrink: bool = False) -> str | None:
    """Why in-job recovery (``ddp-hpc launch --recover``) cannot keep this run going, or
    None: it rebuilds a lost rank from a survivor's memory (ddp) or from the snapshots of
    its shards a buddy holds (fsdp2); ZeRO's optimizer shards have no snapshots.
    ``shrink``: the launch goes on with fewer ranks (``--shrink``)."""
    if shrink:
        return ("the Trainer does not yet go on with fewer ranks under --recover --shrink (the rest of the epoch, "
                "the learning rate and the schedule would need re-planning): launch with --recover alone, where a "
                "replacement takes the lost rank's place")
    if config.training.zero_optimizer:
        return ("in-job recovery (--recover) cannot keep training.zero_optimizer: each rank holds one shard of the "
                "optimizer state, so a lost rank's part is gone; set training.zero_optimizer=false or launch "
                "without --recover")
    return None


def wrap_model(model: nn.Module, config: Config, ctx: DistContext) -> nn.Module:
    """The module the training step calls: DDP around ``model``, or ``model`` itself
    sharded by FSDP2. Without a process group (one plain process) ``model`` unchanged."""
    check_supported(config)  # train() checked before the group; a Trainer built directly has not
    if config.training.strategy == "fsdp2":
        units = shard_units(model, config.fsdp)  # checks fsdp.wrap with or without a group
        return shard_model(model, units, config.fsdp, ctx) if ctx.group_initialized else model
    return _wrap_ddp(model, config, ctx) if ctx.group_initialized else model


def _wrap_ddp(model: nn.Module, config: Config, ctx: DistContext, *,
              recovering: bool = False) -> DistributedDataParallel:
    """``recovering``: for in-job recovery, which wraps the model anew on each group: with
    ``find_unused_parameters`` the buckets keep their first layout, so a step redone after a
    recovery sums its gradients in the same order (``engine/recovery/rank.py``)."""
    dist = config.distributed
    wrapped = DistributedDataParallel(
        model, device_ids=ctx.device.ddp_device_ids,
        find_unused_parameters=dist.find_unused_parameters or recovering, static_graph=dist.static_graph,
        bucket_cap_mb=dist.bucket_cap_mb, gradient_as_bucket_view=dist.gradient_as_bucket_view)
    if dist.comm_hook == "bf16" and ctx.device.backend not in ("nccl", "xccl"):
        raise UserError(f"distributed.comm_hook=bf16 needs the nccl or xccl backend, not "
                        f"{ctx.device.backend}: use comm_hook=fp16")
    if dist.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        wrapped.register_comm_hook(state=None, hook=hook[dist.comm_hook])
    return wrapped


def wrap_ddp_for_recovery(model: nn.Module, config: Config, ctx: DistContext) -> DistributedDataParallel:
    """The DDP wrapper in-job recovery makes for each new group (``InJobRecovery.run``'s ``wrap``)."""
    return _wrap_ddp(model, config, ctx, recovering=True)


def shard_units(model: nn.Module, fsdp: FsdpConfig) -> list[nn.Module]:
    """The submodules sharded as units of their own, innermost first (the order
    ``fully_shard`` needs): classes named in ``fsdp.wrap``, and modules holding at least
    ``fsdp.min_params`` parameters outside the units inside them. The root is not listed."""
    wanted = set(fsdp.wrap)
    present = {type(module).__name__ for module in model.modules()}
    missing = sorted(wanted - present)
    if missing:
        raise UserError(f"fsdp.wrap names {', '.join(missing)}, which the model does not contain "
                        f"(its module classes: {', '.join(sorted(present))})")
    units: list[nn.Module] = []
    in_units: set[int] = set()  # ids of parameters already inside a unit
    for module in _post_order(model):
        if module is model:
            continue
        own = [p for p in module.parameters() if id(p) not in in_units]
        by_size = fsdp.min_params is not None and sum(p.numel() for p in own) >= fsdp.min_params
        if type(module).__name__ in wanted or by_size:
            units.append(module)
            in_units.update(id(p) for p in own)
    return units


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def shard_model(model: nn.Module, units: list[nn.Module], fsdp: FsdpConfig, ctx: DistContext) -> nn.Module:
    """``model`` sharded in place over every rank by ``fully_shard`` (and returned), each
    of ``units`` (``shard_units``) a unit of its own."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The mesh on the ranks' own device type: torch's default would take the accelerator
    # even where the ranks train on CPU.
    mesh = init_device_mesh(ctx.device.device_type, (ctx.world_size,))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": fsdp.reshard_after_forward}
    if fsdp.mixed_precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    names = ", ".join(sorted({type(unit).__name__ for unit in units})) or "the whole model only"
    for unit in units:
        if fsdp.activation_checkpointing:
            checkpoint(unit)
        fully_shard(unit, **options)
    fully_shard(model, **options)  # torch keeps the root's parameters gathered from forward to backward
    if ctx.is_rank_zero:
        log.info("fsdp2: %d units sharded over %d ranks (%s)%s%s", len(units) + 1, ctx.world_size,
                 names,
                 ", bf16 compute" if fsdp.mixed_precision == "bf16" else "",
                 ", activations recomputed" if fsdp.activation_checkpointing else "")
    return model


def is_sharded(model: nn.Module) -> bool:
    if fsdp2_refusal(installed()):
        return False  # nothing is sharded where fsdp2 is refused, and FSDPModule may not exist
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def model_state(model: nn.Module) -> dict[str, Any] | None:
    """The whole model's state dict. Sharded: a collective (every rank calls it), gathered
    to host memory on rank 0 only; other ranks get None."""
    return whole_model_state(model) if is_sharded(model) else model.state_dict()


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict[str, Any] | None:
    """The whole optimizer state, on rank 0 at least (None where a rank has none to give).
    ZeRO and FSDP2 gather it: collectives every rank calls."""
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if ctx.is_rank_zero else None
    return whole_optimizer_state(model, optimizer) if is_sharded(model) else optimizer.state_dict()


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a whole optimizer state (every rank holds it) into ``optimizer``; sharded, each
    rank keeps its slice."""
    if is_sharded(model):
        load_whole_optimizer(model, optimizer, state)
    else:
        optimizer.load_state_dict(state)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (a DTensor's local shard, else the tensor)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor`` (a DTensor is gathered: a collective every rank calls)."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters plus optimizer state this rank holds (its shards under fsdp2)."""
    tensors = [*model.parameters(), *_tensors(list(optimizer.state.values()))]
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)

"""The model-wrapping step: how every rank's model joins the process group (DDP here)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.config import Config
from ddp_hpc.distributed import DistContext
from ddp_hpc.errors import UserError


def wrap_model(model: nn.Module, config: Config, ctx: DistContext) -> nn.Module:
    """``model`` wrapped for training on every rank of ``ctx`` (itself without a group)."""
    if not ctx.group_initialized:
        return model
    dist = config.distributed
    wrapped = DistributedDataParallel(
        model, device_ids=ctx.device.ddp_device_ids,
        find_unused_parameters=dist.find_unused_parameters, static_graph=dist.static_graph,
        bucket_cap_mb=dist.bucket_cap_mb, gradient_as_bucket_view=dist.gradient_as_bucket_view)
    if dist.comm_hook == "bf16" and ctx.device.backend not in ("nccl", "xccl"):
        raise UserError(f"distributed.comm_hook=bf16 needs the nccl or xccl backend, not "
                        f"{ctx.device.backend}: use comm_hook=fp16")
    if dist.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        wrapped.register_comm_hook(state=None, hook=hook[dist.comm_hook])
    return wrapped

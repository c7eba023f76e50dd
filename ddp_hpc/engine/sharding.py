"""What a sharded (FSDP2) model asks of the objects around it, and its whole state.

``fully_shard`` replaces every parameter of the modules it shards with a DTensor of which
each rank holds one slice; gradients of those are reduced over the ranks, and nothing else
is. Two mistakes therefore train wrongly without a word, and are refused in one line
(``Checkpointer``, ``InJobRecovery.run``):

- the root not sharded while its blocks are: the parameters the root owns stay plain
  tensors, never reduced, and every rank trains its own copy of them (``model_refusal``);
- an optimizer built before ``fully_shard``: it steps the tensors of before the sharding,
  which the model no longer uses, so nothing is trained (``optimizer_refusal``).

A single-file checkpoint (``format="file"``) holds the whole state of a sharded model and of
its optimizer, gathered to rank 0 (``whole_model_state``, ``whole_optimizer_state``:
collectives every rank joins), and each rank takes its own slice of it back on restore
(``load_whole_model``, ``load_whole_optimizer``): it loads on any world size, and into a
plain model. Optimizer state is kept numbered in ``param_groups`` order, as
``optimizer.state_dict()`` numbers it, so a checkpoint resumes under DDP or FSDP2 alike.

A sharded model's buffers are not sharded and not reduced: each rank's BatchNorm statistics
(or any buffer its forward updates) are its own, and a checkpoint's model state holds one
rank's (rank 0's: DCP keeps the lowest rank's copy of what every rank has, the single file is
rank 0's). Each rank's own go into its part of the checkpoint (``own_buffers``) and come back
over the model's on a restore on the same world size (``load_own_buffers``), so that a resume
is bit-identical on every rank, not only on rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

#: Parameter names a refusal lists before it says "and N more".
NAMED = 4


def fsdp_module_type() -> type | None:
    """FSDP2's ``FSDPModule``, or None where this torch has none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:  # torch < 2.6 has it only where fully_shard was born
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def is_sharded(model: Any) -> bool:
    """``model`` is a module of which it or a module in it is sharded by FSDP2 (``fully_shard``)."""
    fsdp = fsdp_module_type()
    return fsdp is not None and isinstance(model, nn.Module) and any(isinstance(m, fsdp) for m in model.modules())


def _is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(tensor, DTensor)


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    return ", ".join(names[:NAMED]) + more


def model_refusal(model: nn.Module) -> str | None:
    """Why a sharded ``model`` would train wrongly (one line), or None: parameters outside
    every ``fully_shard`` unit (its root not sharded) are never reduced over the ranks."""
    if not is_sharded(model):
        return None
    plain = [name for name, p in model.named_parameters() if p.requires_grad and not _is_dtensor(p)]
    if not plain:
        return None
    return (f"the model is sharded (fully_shard) but its parameter(s) {_listed(plain)} belong to no fully_shard "
            "unit, so they are never reduced over the ranks (each rank would train its own copy): call "
            "fully_shard(model) on the root too, after its blocks")


def optimizer_refusal(models: Iterable[nn.Module], optimizer: Any, name: str = "the optimizer") -> str | None:
    """Why ``optimizer`` cannot step the sharded one(s) of ``models`` (one line), or None:
    every tensor it steps must be one of their parameters, by identity. One built before
    ``fully_shard`` steps the tensors the sharding replaced (nothing is trained)."""
    models = list(models)
    if not any(is_sharded(model) for model in models) or not isinstance(optimizer, torch.optim.Optimizer):
        return None
    known = {id(p) for model in models for p in model.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(1 for p in stepped if id(p) not in known)
    if not foreign:
        return None
    return (f"{name} steps {foreign} of its {len(stepped)} tensors that are not the sharded model's parameters: "
            "build it after fully_shard, from model.parameters() (fully_shard replaces every parameter it "
            "shards, and an optimizer built before it trains nothing)")


def _full_options(**extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def whole_model_state(model: nn.Module) -> dict[str, Any] | None:
    """The whole state dict of a sharded ``model``, gathered to host memory on rank 0; None
    on the other ranks. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=True)) or None


def load_whole_model(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a whole state dict (every rank holds it) into a sharded ``model``: each rank
    keeps its own slice."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_full_options())


def whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The whole state of ``optimizer`` (stepping a sharded ``model``), numbered as
    ``optimizer.state_dict()`` numbers it, on rank 0; None on the other ranks. A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    return numbered(state) if state else None


def load_whole_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a whole, numbered optimizer state (every rank holds it): each rank keeps its slice."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, named(state, model, optimizer), options=_full_options())


# torch names a sharded optimizer's parameters by their module paths, ``optimizer.state_dict()``
# numbers them in ``param_groups`` order; checkpoints keep the numbers, so that a checkpoint
# resumes under either strategy.

def numbered(state: dict[str, Any]) -> dict[str, Any]:
    number = {name: i for i, name in enumerate(n for group in state["param_groups"] for n in group["params"])}
    return {"state": {number[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [number[n] for n in group["params"]]}
                             for group in state["param_groups"]]}


def named(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # The names torch's state-dict API gives (wrappers' prefixes such as activation
    # checkpointing's ``_checkpoint_wrapped_module.`` left out), not named_parameters()'s.
    from torch.distributed.checkpoint.state_dict import _get_fqns

    name_of = {id(p): next(iter(_get_fqns(model, name))) for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                             for group in state["param_groups"]]}


def holds_shards(state: Any) -> bool:
    """``state`` (a saved state dict) holds DTensors: one rank's slices, not a whole state."""
    if _is_dtensor(state):
        return True
    if isinstance(state, dict):
        return any(holds_shards(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_shards(value) for value in state)
    return False


def own_buffers(objects: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Each sharded module's buffers as this rank holds them (host copies), by object name."""
    return {name: {fqn: buffer.detach().to("cpu", copy=True) for fqn, buffer in obj.named_buffers()
                   if not _is_dtensor(buffer)}
            for name, obj in objects.items() if is_sharded(obj)}


def load_own_buffers(objects: dict[str, Any], saved: dict[str, dict[str, torch.Tensor]]) -> None:
    """Put this rank's saved buffers back into its sharded modules (those of the same name and shape)."""
    for name, buffers in saved.items():
        module = objects.get(name)
        if not isinstance(module, nn.Module):
            continue
        for fqn, buffer in module.named_buffers():
            value = buffers.get(fqn)
            if value is not None and not _is_dtensor(buffer) and value.shape == buffer.shape:
                with torch.no_grad():
                    buffer.copy_(value)

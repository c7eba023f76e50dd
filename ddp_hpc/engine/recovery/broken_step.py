"""What a step broken by a lost peer leaves on a survivor, and the one reset that clears it.

A survivor's collective fails somewhere inside a step: in its forward, its backward (after
some gradients were computed), between two micro-batches of an accumulation, around its
optimizer step. Before the step is done again, everything that step changed is cleared or
put back, so that the redone step starts where the uninterrupted run started it:

- gradients: every parameter's, and under FSDP2 also those on the unsharded parameters
  (a backward broken before its unit's reduce-scatter leaves the gradient there: the root
  owns parameters whose reduce-scatter runs last, so theirs is always left) and the
  accumulated ones of a ``set_requires_gradient_sync(False)`` accumulation;
- FSDP2's per-step state (``shards.reset_after_failure``): gathered parameters, pending
  collectives, training states;
- buffers changed by the broken forward (BatchNorm's running statistics): put back as they
  were at the last step's end (``StepStart``), each survivor its own. Rank 0's exist on rank
  0 only (DDP broadcasts them at the start of each forward, then each rank updates its own),
  so every rank also holds rank 0's of the last step's end (``StepStart.received``): they
  arrive in each step's optimizer step (``StepStart.share``, one broadcast), or in the next
  step's first forward, and a replacement of rank 0 takes them. A sharded model's come back
  with its snapshot instead;
- a gradient scaler's per-step stages (``fresh_scaler_stages``);
- an optimizer step applied but not yet counted (``StepStart.applied``): a DDP member that
  applied it is not a source of the state (its parameters are a step ahead of its count).

The RNG streams need nothing here: every rank reseeds them from the step it continues at.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class StepStart:
    """What a DDP model's step changes before its optimizer step that no transfer puts
    back: its buffers (kept at each step's end, put back on a survivor before the state
    travels), rank 0's buffers of the step before (``received``: those the first forward of
    a step starts from under DDP's ``broadcast_buffers``), and whether this step's
    optimizer step was applied (``applied``: set by the optimizer's post-hook, cleared when
    the step is counted)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._received: dict[str, torch.Tensor] = {}
        #: The step (completed steps + 1) that ``received`` starts: rank 0's of its step before.
        self._received_in = -1
        #: The step whose first forward ``received`` was last taken in (``watch``).
        self._forward_in = -1
        #: Rank 0's buffers of the step being done, broadcast in its optimizer step (``share``).
        self._shared: dict[str, torch.Tensor] = {}
        self._shared_in = -1
        #: Whether ``received`` is taken in each step's first forward, which starts from rank
        #: 0's buffers under DDP's ``broadcast_buffers``: over gloo, where the broadcast is
        #: whole once the forward runs. Over NCCL it may have been cut short by an abort, so
        #: only ``share``'s broadcast, which the fence waits for, counts.
        self.forward_receives = True
        self.applied = False

    def attach(self, optimizer: torch.optim.Optimizer, ignore: Callable[[], bool] = lambda: False) -> Any:
        """Marks each applied step of ``optimizer`` from now on, but those made while
        ``ignore()`` (a Checkpointer's save: torch's state-dict API steps an optimizer that
        has no state yet at lr 0 to create it); the handle's ``remove()`` ends that."""
        def mark(*_: Any) -> None:
            if not ignore():
                self.applied = True

        return optimizer.register_step_post_hook(mark)

    def watch(self, model: nn.Module, steps_done: Callable[[], int]) -> Any:
        """Keeps the buffers each step's first forward of ``model`` starts from (a forward
        pre-hook of the module DDP wraps: it runs after DDP's broadcast of rank 0's
        buffers), where ``forward_receives``; ``steps_done``: the steps completed. They
        replace the ones ``share`` gave: they hold what the loop changed after the optimizer
        step too. The handle's ``remove()`` ends that."""
        def take(module: nn.Module, _args: Any) -> None:
            step = steps_done() + 1
            # An evaluation's forward broadcasts nothing.
            if self.forward_receives and module.training and step != self._forward_in:
                self._received, self._received_in = _copied(module, self._received), step
                self._forward_in = step
        return model.register_forward_pre_hook(take)

    def share(self, optimizer: torch.optim.Optimizer, model: nn.Module, steps_done: Callable[[], int],
              broadcast: Callable[[list[torch.Tensor]], None], ignore: Callable[[], bool] = lambda: False) -> Any:
        """Before each optimizer step of ``optimizer`` (but those made while ``ignore()``),
        rank 0's buffers of ``model`` reach every rank (``broadcast``: group rank 0's tensors
        into each rank's), as they are after the step's forwards. Rank 0 lost before that
        broadcast ends fails it on the survivors, whose step is then neither applied nor
        counted, and they go on from the step before, whose rank 0's buffers they hold; lost
        after it, they hold its buffers of this step (``counted``). Register it before the
        optimizer's other pre-hooks (the NCCL fence waits for this broadcast too). The
        handle's ``remove()`` ends that."""
        def send(*_: Any) -> None:
            if not ignore():
                self._shared_in = -1
                self._shared = _copied(model, self._shared)
                broadcast(list(self._shared.values()))
                self._shared_in = steps_done() + 1

        return optimizer.register_step_pre_hook(send)

    def counted(self, step: int) -> None:
        """Step ``step`` is counted: rank 0's buffers its optimizer step broadcast become those
        the next step starts from (``received``). A step whose optimizer step did not run (a
        gradient scaler skipped it) broadcast none: the next forward's are taken (over gloo),
        and rank 0 lost before that forward leaves none of that step."""
        if self._shared_in == step:
            self._received, self._shared = self._shared, self._received
            self._received_in, self._shared_in = step + 1, -1

    def transferred(self, received: dict[str, torch.Tensor] | None, step: int) -> None:
        """After a transfer that goes on from ``step``: rank 0's buffers of its end, as the
        sending rank held them (None: none), on every rank; nothing of a broken step is kept."""
        self._received, self._received_in = (dict(received), step + 1) if received is not None else ({}, -1)
        self._forward_in = self._shared_in = -1

    def received(self, step: int) -> dict[str, torch.Tensor] | None:
        """Rank 0's buffers of step ``step - 1``'s end (those step ``step``'s first forward
        starts from), where this rank holds them."""
        return dict(self._received) if self._received_in == step else None

    def keep(self, model: nn.Module) -> None:
        """The model's buffers as they are now: a step's end (or the state just loaded)."""
        self._buffers = _copied(model, self._buffers)

    def put_back(self, model: nn.Module) -> None:
        """The buffers as kept last (what a broken forward changed is undone); a broadcast of
        the broken step (``share``) is not one to go on from."""
        load_buffers(model, self._buffers)
        self._shared_in = -1


def _copied(model: nn.Module, into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s buffers, in the tensors of ``into`` where they fit."""
    kept = {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            copy = into.get(name)
            if copy is None or copy.shape != buffer.shape or copy.dtype != buffer.dtype or copy.device != buffer.device:
                copy = torch.empty_like(buffer)
            kept[name] = copy.copy_(buffer)
    return kept


def load_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """``buffers`` (by name) into ``model``'s."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers and buffers[name].shape == buffer.shape:
                buffer.copy_(buffers[name])


def clear_broken_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, objects: Iterable[Any],
                      *, sharded: bool, step_start: StepStart | None = None) -> None:
    """Everything of the broken step on this survivor cleared (see the module's docstring),
    before any state travels; ``objects``: the other objects that travel (a gradient scaler)."""
    if sharded:
        from ddp_hpc.engine.recovery.shards import reset_after_failure

        reset_after_failure(model)
    elif step_start is not None:
        step_start.put_back(model)
    clear_gradients(model, optimizer)
    for obj in objects:
        if isinstance(obj, torch.amp.GradScaler):
            fresh_scaler_stages(obj)


def clear_gradients(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """No gradient is left anywhere: the model's parameters, the optimizer's (it may hold
    tensors the model does not list), and FSDP2's unsharded and accumulated ones."""
    for param in model.parameters():
        param.grad = None
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    for fsdp_param in _fsdp_params(model):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)  # made at its first all-gather
        if unsharded is not None:
            unsharded.grad = None
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            fsdp_param.unsharded_accumulated_grad = None


def _fsdp_params(model: nn.Module) -> list[Any]:
    from ddp_hpc.engine.recovery.shards import fsdp_param_groups

    return [fsdp_param for group in fsdp_param_groups(model) for fsdp_param in group.fsdp_params]


def fresh_scaler_stages(scaler: torch.amp.GradScaler) -> None:
    """``scaler`` as after its ``update()``: a step refused inside ``scaler.step`` (over NCCL,
    ``GroupAborted`` from the optimizer's pre-hook) left its optimizer's stage at "unscaled"
    and its inf check behind, and the step done again would apply gradients not unscaled.
    ``load_state_dict`` keeps the stages; torch's own ``update()`` clears them this way."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)

"""The state transfer of a recovery: which member sends (the lowest clean step), what
travels (model, optimizer, sampler, the Checkpointer's objects, RNG bases), how each rank
loads it, and the record of each recovery."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddp_hpc.engine.recovery import store as keys
from ddp_hpc.engine.group import ProcessGroupView
from ddp_hpc.engine.recovery.broken_step import load_buffers
from ddp_hpc.engine.recovery.errors import RecoveryError
from ddp_hpc.engine.recovery.fence import wait_for_stream
from ddp_hpc.engine.recovery.payload import PIECE_BYTES, pieces, state_from_tensor, state_to_tensor
from ddp_hpc.engine.recovery.record import RecoveryEvent, write_recovery
from ddp_hpc.engine.recovery.shards import restored_dtensors
from ddp_hpc.engine.rng import seed_for_step
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.engine.recovery.snapshot_keeping import rollback_fields

log = logging.getLogger(__name__)


#: The Checkpointer's rank extra that keeps a rank's base seed across a restart.
STREAM_SEED = "stream_seed"


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Group rank 0's ``tensors`` into every rank's, one broadcast per device and dtype (a
    model's buffers: BatchNorm's float statistics and int64 counts), as DDP's own buffer
    broadcast does."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for group in kinds.values():
            flat = _flatten_dense_tensors(group)
            dist.broadcast(flat, src=0)
            if dist.get_rank() != 0:
                for tensor, value in zip(group, _unflatten_dense_tensors(flat, group)):
                    tensor.copy_(value)


def broadcast_state(state: dict[str, Any] | None, source: int, device: torch.device | None = None,
                    check: Callable[[], None] | None = None) -> dict[str, Any]:
    """``state`` of rank ``source`` on every rank: ``torch.save`` into bytes on the source,
    broadcast as uint8 tensors (its size first, then pieces of ``PIECE_BYTES``, so that a
    GPU holds one piece, not the whole state) on ``device`` (the group's: CPU for
    gloo, the rank's GPU for nccl), ``torch.load(weights_only=True)`` on the others (as every
    checkpoint is read: tensors and plain data only, no code runs). ``check`` is asked after
    each piece reaches the host (over NCCL, whether the group was aborted meanwhile)."""
    device = torch.device("cpu") if device is None else device
    check = check or (lambda: None)
    sending = dist.get_rank() == source
    payload = state_to_tensor(state) if sending else None  # type: ignore[arg-type]
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=source)
    total = int(size)
    check()
    received = payload if payload is not None else torch.empty(total, dtype=torch.uint8)
    for start in pieces(total):
        piece = received[start:start + PIECE_BYTES].to(device)
        dist.broadcast(piece, src=source)
        if sending:
            wait_for_stream(device.type)  # this piece sent before the next is put on the device
        else:
            received[start:start + piece.numel()] = piece.cpu()
            check()
    if sending:
        assert state is not None
        return state
    return state_from_tensor(received)


def transfer_source(reports: Sequence[tuple[int, bool]], slot: int) -> tuple[int, int]:
    """The step every member continues from and the group rank that sends it, from each
    member's (steps completed, optimizer step applied since) (-1: a replacement): the lowest
    step among the members whose parameters are those of their count. One whose optimizer
    step was applied before a collective of the same step failed (one between
    ``optimizer.step()`` and ``step_done()``) holds parameters a step ahead of its count,
    and the step cannot be done again from it: where no member is clean, ``RecoveryError``
    (the launch restarts in place, from the checkpoint)."""
    clean = [(step, rank) for rank, (step, applied) in enumerate(reports) if step >= 0 and not applied]
    if not clean:
        raise RecoveryError(f"rank {slot}: every survivor had applied its optimizer step when a collective of the same "
                            "step failed (a collective between optimizer.step() and step_done(): do it before the "
                            "optimizer step or after step_done); the launch restarts the job in place")
    return min(clean)


class StateTransfer:
    """``InJobRecovery``'s part that sends the state to every member of a new group and loads
    it. Its attributes are ``InJobRecovery``'s (rank.py)."""

    def _transfer(self, plan: keys.Plan, joining: bool) -> None:
        """Agree on the step to continue from, send the state from the lowest rank there,
        and set this rank's streams to those after that step."""
        formed = time.time()
        self._follow_group()
        rollback = None
        if self._snapshots is not None:
            rollback = self._roll_back()
            step = rollback.step
        else:
            device = ProcessGroupView.current().device
            mine = torch.tensor([-1 if joining else self.step, int(self._step_start.applied)], dtype=torch.int64,
                                device=device)
            reports = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(reports, mine)
            self._check_group()
            step, source = transfer_source([(int(report[0]), bool(report[1])) for report in reports], self.slot)
            sent = None
            if dist.get_rank() == source:
                sent = self._state()
                if self._keeps_buffers:  # rank 0's, of the last step's end, where a replacement of rank 0 needs them
                    sent["received_buffers"] = self._step_start.received(step + 1)
            self._load(broadcast_state(sent, source, device, self._check_group), shrunk=not plan.replaced,
                       joining=joining)
        assert self.seed is not None
        seed_for_step(self.seed, step)
        self.step = step
        if self._stop_agreement is not None:
            self._stop_agreement.continue_at(step)
        self._pending = {"plan": plan, "group_s": formed - plan.detected_at,
                         "transfer_s": time.time() - plan.detected_at, "rollback": rollback}

    def _check_group(self) -> None:
        """What the group's last collective gave is whole: over NCCL an abort (a member lost
        meanwhile) ends it without an error, so it is asked (``GroupAborted``: the next plan)."""
        if self._fence is not None:
            self._fence.check()

    def _follow_group(self) -> None:
        """The loop's Checkpointer and StopAgreement act on the group formed last."""
        view = ProcessGroupView.current()
        if self._checkpointer is not None:
            self._checkpointer.group = view
        if self._stop_agreement is not None:
            self._stop_agreement.group = view

    def _advanced_by_checkpointer(self, obj: Any) -> bool:
        held = self._checkpointer.objects.values() if self._checkpointer is not None else ()
        return any(one is obj for one in held)

    def _objects(self) -> dict[str, Any]:
        """What travels: model, optimizer, sampler and the Checkpointer's other objects."""
        assert self._model is not None and self._optimizer is not None
        objects = {"model": self._model, "optimizer": self._optimizer, "sampler": self._sampler}
        if self._checkpointer is not None:
            for name, obj in self._checkpointer.objects.items():
                if not any(obj is known for known in objects.values()):
                    objects[f"checkpointer/{name}"] = obj
        return {name: obj for name, obj in objects.items() if obj is not None}

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step,
                                 "objects": {name: obj.state_dict() for name, obj in self._objects().items()}}
        if self._checkpointer is not None:
            state["checkpointer"] = self._checkpointer.bookkeeping()
        return state

    def _load(self, state: dict[str, Any], shrunk: bool, joining: bool = False) -> None:
        self._repeated = 0
        # A snapshot's shards travel as plain tensors: made DTensors again as the live objects' are.
        sharded = [path[1:] for path in state.get("dtensors", ()) if path and path[0] == "objects"]
        for name, obj in self._objects().items():
            if isinstance(obj, ResumableSampler):  # dealt out over the new group
                obj.num_replicas, obj.rank = dist.get_world_size(), dist.get_rank()
            own = state["objects"][name]
            obj.load_state_dict(restored_dtensors(name, own, sharded, obj) if sharded else own)
            if isinstance(obj, ResumableSampler) and shrunk:
                self._repeated = max(self._repeated, obj.repeated)
        if self._checkpointer is not None:
            self._checkpointer.continue_from(state["checkpointer"])
        self._step_start.applied = False
        if self._keeps_buffers and self._model is not None:
            self._take_buffers(state, joining)
            self._step_start.keep(self._model)
            self._step_start.transferred(state.get("received_buffers"), state["step"])

    def _take_buffers(self, state: dict[str, Any], joining: bool) -> None:
        """A DDP model's buffers after a transfer: a survivor at the step the group goes on
        from keeps its own (as at that step's end); rank 0 otherwise (a replacement, or a
        step ahead) takes rank 0's of that step's end, which every rank holds
        (``StepStart.received``; DDP broadcasts rank 0's buffers at each forward: the other
        ranks' are overwritten by them before use)."""
        assert self._model is not None
        if not joining and self.step == state["step"]:
            self._step_start.put_back(self._model)
        elif dist.get_rank() == 0:
            received = state.get("received_buffers")
            if received is not None:
                load_buffers(self._model, received)
            elif any(True for _ in self._model.buffers()):
                log.warning("rank %d: rank 0's buffers (BatchNorm's running statistics) were lost with it before they "
                            "reached the other ranks (a step without an optimizer step): they go on from the "
                            "sending rank's", self.slot)

    def _base_seed(self) -> int:
        """This slot's base seed: the one its first process ran with (``torch.initial_seed()``
        at ``run``: what the script seeded), or, after a restore, the one the checkpoint kept
        in this rank's part (restoring the streams reseeded torch with a step's seed). Kept
        in the Checkpointer's rank extras for a restart, and in the store for replacements,
        which take it from there whatever they seeded (a warm spare seeded before it had a
        slot)."""
        kept = self._checkpointer.rank_extras.get(STREAM_SEED) if self._checkpointer is not None else None
        base = int(kept) if kept is not None else torch.initial_seed()
        if self._store is not None:
            key = keys.seed_key(self.slot)
            if self.joining and self._store.check([key]):
                base = int(self._store.get(key))
            else:
                if self.joining:
                    log.warning("rank %d: the rank it replaces left no seed (lost before its first step): using "
                                "its own", self.slot)
                self._store.set(key, str(base))
        if self._checkpointer is not None:
            self._checkpointer.rank_extras[STREAM_SEED] = base
        return base

    def _finish_recovery(self) -> None:
        """The first step after a recovery is done: one record per rank lost since the group
        before trained (two ranks lost at once, or a replacement that died before its group
        trained, are plans this group's absorbed), each with its own cause and times."""
        pending, self._pending = self._pending, None
        assert pending is not None
        plan: keys.Plan = pending["plan"]
        events = [self._recovery_event(lost, plan, pending) for lost in [*self._absorbed(plan), plan]]
        self.recoveries.extend(events)
        if dist.get_rank() == 0:
            assert self._store is not None
            self._store.set(keys.recovered_key(plan.generation), "1")  # the launch may start the next spare
            for event in events:
                log.warning("recovered from the loss of rank %d (%s%s) in %.2f s: %d ranks, continuing after step %d",
                            event.rank, "a replacement: " if event.replacement else "", event.cause,
                            event.recover_s, event.world_size, event.step)
                if self.run_dir is not None:
                    write_recovery(self.run_dir, event)

    def _recovery_event(self, lost: keys.Plan, plan: keys.Plan, pending: dict[str, Any]) -> RecoveryEvent:
        """The record of ``lost``'s loss, recovered by ``plan``'s group: its times from its own detection."""
        formed, transferred = plan.detected_at + pending["group_s"], plan.detected_at + pending["transfer_s"]
        return RecoveryEvent(generation=lost.generation, rank=lost.lost, host=lost.host, cause=lost.cause,
                             replaced=lost.replaced, world_size=lost.world_size, step=self.step - 1,
                             detected_at=lost.detected_at, group_s=round(formed - lost.detected_at, 4),
                             transfer_s=round(transferred - lost.detected_at, 4),
                             recover_s=round(time.time() - lost.detected_at, 4), repeated_samples=self._repeated,
                             replacement=lost.replacement, recovered_in=plan.generation, restart=self._restarts,
                             **rollback_fields(pending["rollback"]))

"""In-job recovery for DDP: a lost rank costs seconds, not a restart.

Under DDP every rank holds the whole model, optimizer state and its place in the data, so
a lost rank needs nothing from disk. ``InJobRecovery`` starts the process group in place
of ``dist.init_process_group`` and runs the user's training function; when a collective
fails (gloo raises within milliseconds once a peer's connection closes; a frozen peer is
ended by the launch, which closes it):

1. the survivors leave the broken group without exiting (``destroy_process_group``);
2. they wait for the launch's ``Plan`` of the next generation (``engine/recovery_store.py``):
   the same ranks with a replacement the launch started for the lost one, or, where the
   user allowed shrinking, the survivors only, numbered anew;
3. they form the new group on the store under a fresh prefix (the generation), as torchft
   does for each quorum (``torchft/process_group.py``, ``configure``);
4. the lowest rank at the lowest step every member completed sends model, optimizer,
   sampler position and step, and the objects and bookkeeping of the loop's
   ``Checkpointer`` (``torch.save`` into bytes, broadcast as one uint8 tensor, read with
   ``torch.load(weights_only=True)``: only tensors and plain data travel); ranks one step
   ahead (they finished the failed step's all-reduce before the peer's loss reached them)
   go back to it, and every rank takes its RNG streams as they were after that step (its
   own copy; a replacement reads the lost rank's from the store, where each rank leaves
   them every step);
5. the loop's ``Checkpointer`` and ``StopAgreement`` are pointed at the new group (its
   rank 0 writes the checkpoints), DDP is wrapped anew on it and the training function is
   called again: it continues from the sampler's position, redoing the step that failed.

No checkpoint is read and no completed step is lost. Unlike torchft (a quorum and a commit
vote every step), nothing is added to a step but an RNG copy to the store: the launch that
started the ranks sees which one ended, so no per-step agreement is needed.

Limits: DDP only (FSDP2's shards exist once; refused). The state travels in one
broadcast, serialized whole on the sender (fine for models of a few GB on one host;
larger ones would broadcast tensor by tensor). Without a launch that recovers (``ddp-hpc
launch --recover``), a failure ends the rank as before and the launcher restarts in place.
"""

from __future__ import annotations

import gc
import io
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.contract import RECOVERY_GENERATION_VAR, RECOVERY_SPARE_VAR, RECOVERY_STORE_VAR, RECOVERY_WAIT_VAR
from ddp_hpc.engine import recovery_store as keys
from ddp_hpc.engine.checkpointer import Checkpointer
from ddp_hpc.engine.group import ProcessGroupView
from ddp_hpc.engine.recovery_record import RecoveryEvent, write_recovery
from ddp_hpc.engine.rng import capture_rng, restore_rng
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.engine.stop_agreement import StopAgreement
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_collective_error(exc: BaseException) -> bool:
    """A collective failed because a peer is gone: torch's ``DistError``s, and the plain
    ``RuntimeError`` gloo raises from its transport ("[.../gloo/transport/tcp/pair.cc:553]
    Connection closed by peer"). Any other error is the user's and ends the rank as before."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport" in str(exc))

#: Seconds a rank waits for the next group to form when the launch does not say.
DEFAULT_WAIT_S = 120.0


class RecoveryError(RuntimeError):
    """The job cannot recover in place (no new group in time, a lost RNG stream): the rank
    exits with a failure and the launch restarts in place from the newest checkpoint."""


class InJobRecovery:
    """Starts this rank's process group and keeps DDP training through a lost rank.

    ``backend``: ``gloo`` (CPU) or another ``torch.distributed`` backend. ``run_dir``: where
    each recovery is recorded (``record/``), on rank 0 of the new group. ``ddp_kwargs`` go
    to each ``DistributedDataParallel`` (``find_unused_parameters=True`` unless given: it
    keeps the bucket layout, hence the sums, the same across a re-wrap). ``collective_timeout_s``: how long a collective
    may wait for a silent peer before it fails.
    """

    def __init__(self, backend: str = "gloo", *, run_dir: str | os.PathLike[str] | None = None,
                 ddp_kwargs: Mapping[str, Any] | None = None, collective_timeout_s: float = 300.0,
                 heartbeat_s: float = 0.25, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.backend, self.run_dir = backend, Path(run_dir) if run_dir is not None else None
        # A DDP that rebuilds its buckets after its first step lays the gradients out anew, and
        # gloo's ring then sums some of them in another order: the step after a re-wrap would
        # differ in the last bits from the same step without a recovery. With
        # find_unused_parameters the buckets are never rebuilt (the reducer's
        # should_rebuild_buckets), so every wrap sums in the same order.
        self.ddp_kwargs = {"find_unused_parameters": True, **(ddp_kwargs or {})}
        self.collective_timeout = timedelta(seconds=collective_timeout_s)
        self.slot = int(env.get("RANK", "0"))
        self._launch_world_size = int(env.get("WORLD_SIZE", "1"))
        self.generation = int(env.get(RECOVERY_GENERATION_VAR, "0"))
        self.wait_s = float(env.get(RECOVERY_WAIT_VAR, DEFAULT_WAIT_S))
        address = env.get(RECOVERY_STORE_VAR)
        #: Steps completed (``step_done``); a recovery sets it to the step every rank continues from.
        self.step = 0
        self.recoveries: list[RecoveryEvent] = []
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._sampler: Any = None
        self._checkpointer: Checkpointer | None = None
        self._stop_agreement: StopAgreement | None = None
        self._rng: dict[int, dict[str, Any]] = {}
        self._pending: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._group_fds: set[int] = set()
        self._heartbeat: threading.Thread | None = None
        self.enabled = address is not None
        if address is None:
            log.warning("in-job recovery is off (not started by `ddp-hpc launch --recover`): a lost rank ends "
                        "the job and the launcher restarts it in place")
            dist.init_process_group(backend, timeout=self.collective_timeout)
            self._store: dist.Store | None = None
            return
        self._store = keys.connect(address, self.wait_s)
        spare = env.get(RECOVERY_SPARE_VAR)
        if spare is not None:
            self.slot = self._wait_as_spare(spare)
            self.generation = int(self._store.get(keys.LATEST_KEY))
            if environ is None:  # from here on this process is the rank it replaces, to the script too
                os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(self.slot)
        self._form(self.generation, self._plan(self.generation) if self.generation else None)
        self._heartbeat = threading.Thread(target=self._beat, args=(address, heartbeat_s), daemon=True,
                                           name="ddp_hpc-recovery-heartbeat")
        self._heartbeat.start()
        self._store.set(keys.ready_key(self.slot), "1")

    # ----- the user's loop --------------------------------------------------------------

    @property
    def joining(self) -> bool:
        """This process replaces a lost rank: its state comes from the survivors in ``run``
        (restore no checkpoint before it)."""
        return self.enabled and self.generation > 0

    def run(self, train: Callable[[nn.Module], T], *, model: nn.Module, optimizer: torch.optim.Optimizer,
            sampler: Any = None, checkpointer: Checkpointer | None = None,
            stop: StopAgreement | None = None,
            wrap: Callable[[nn.Module], DistributedDataParallel] | None = None) -> T:
        """``train(ddp_model)`` until it returns, recovering from lost ranks in between.

        ``model`` is the module itself (not wrapped: each group gets its own DDP);
        ``sampler`` a ``ResumableSampler`` whose position ``train`` starts from. ``train``
        calls ``step_done()`` after each optimizer step and is called again after a
        recovery, so it must continue from the sampler's position rather than from scratch.

        ``checkpointer``: the loop's ``Checkpointer`` (holding the bare ``model``): its
        objects (an LR scheduler, say) and step travel with the state, it follows each new
        group, and ``step_done`` counts and saves through it (call it in place of
        ``checkpointer.step_done``). ``stop``: the loop's ``StopAgreement``, which follows
        each new group too (a stop requested on any rank still stops every rank).
        ``wrap``: makes the DDP wrapper of ``model`` for each group (default:
        ``DistributedDataParallel(model, **ddp_kwargs)``); one of the caller's own (device
        ids, a communication hook) should keep ``find_unused_parameters=True`` for the
        reason given in the class's ``__init__``.
        """
        refuse_sharded(model)
        if isinstance(model, DistributedDataParallel):
            raise UserError("InJobRecovery.run takes the model itself: it wraps it in DDP for each group")
        if checkpointer is not None and any(isinstance(obj, DistributedDataParallel)
                                            for obj in checkpointer.objects.values()):
            raise UserError("InJobRecovery.run: give the Checkpointer the model itself, not its DDP wrapper "
                            "(each group gets a wrapper of its own)")
        self._model, self._optimizer, self._sampler = model, optimizer, sampler
        self._checkpointer, self._stop_agreement = checkpointer, stop
        if checkpointer is not None:
            self.step = checkpointer.step  # a restored checkpoint's step
        self._follow_group()
        if self.joining:
            self._transfer(self._plan(self.generation), joining=True)
        else:
            self._keep_rng()
        while True:
            wrapped = None
            try:
                # Inside the try: DDP's constructor checks the parameters with a collective,
                # which fails like any other when a peer is lost while the group is new.
                wrapped = wrap(model) if wrap is not None else DistributedDataParallel(model, **self.ddp_kwargs)
                return train(wrapped)
            except RuntimeError as exc:  # DistError is one
                if not (self.enabled and is_collective_error(exc)):
                    raise
                log.warning("rank %d: a collective failed (%s): recovering in the job", self.slot,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            # DDP holds the broken group: free it (it sits in a reference cycle) before leaving.
            del wrapped
            gc.collect()
            self._recover()

    def step_done(self, batches: int = 1, *, epoch_ends: bool = False, save: bool = True) -> None:
        """One optimizer step is complete on this rank: counts it, advances the sampler (or,
        with a ``checkpointer``, its ``step_done``: the count, its samplers, then its cadence's
        save) and leaves this rank's RNG streams where a replacement finds them.
        ``epoch_ends`` and ``save`` as in ``Checkpointer.step_done`` (``save=False``: the
        caller calls ``checkpointer.save_due()`` itself, once the step's other bookkeeping,
        its callbacks say, is done)."""
        self.step += 1
        checkpointer = self._checkpointer
        if checkpointer is not None:
            checkpointer.step_done(batches, epoch_ends=epoch_ends, save=False)
        if self._sampler is not None and not self._advanced_by_checkpointer(self._sampler):
            self._sampler.advance(batches)
        self._keep_rng()
        if self._pending is not None:
            self._finish_recovery()
        if checkpointer is not None and save:  # a collective: a peer lost in it is recovered from this step on
            checkpointer.save_due()

    def close(self) -> None:
        """Stops the heartbeat (the launch no longer watches this rank) and ends the process group."""
        if self._store is not None:
            self._store.delete_key(keys.ready_key(self.slot))
        self._stop.set()
        if self._heartbeat is not None:  # not left inside a store call when the interpreter ends
            self._heartbeat.join(timeout=self.wait_s)
        if dist.is_initialized():
            dist.destroy_process_group()

    # ----- forming a group --------------------------------------------------------------

    def _plan(self, generation: int) -> keys.Plan:
        assert self._store is not None
        try:
            self._store.wait([keys.plan_key(generation)], timedelta(seconds=self.wait_s))
        except (dist.DistStoreError, RuntimeError) as exc:
            raise RecoveryError(f"rank {self.slot}: no new group from the launch within {self.wait_s:g} s "
                                f"({RECOVERY_WAIT_VAR}); the launch restarts the job in place") from exc
        return keys.Plan.from_json(self._store.get(keys.plan_key(generation)))

    def _wait_as_spare(self, spare: str) -> int:
        """A warm spare (``ddp-hpc launch --warm-spare``): torch is imported and the script
        has run up to here; wait, as long as the launch lives, for the slot of a lost rank."""
        assert self._store is not None
        key = keys.spare_key(spare)
        while True:
            try:
                self._store.wait([key], timedelta(seconds=self.wait_s))
            except dist.DistStoreError:
                if not self._store.check([key]):  # no loss yet (a launch that is gone raises here)
                    continue
            return int(self._store.get(key))

    def _form(self, generation: int, plan: keys.Plan | None) -> None:
        assert self._store is not None
        if plan is None:
            rank, world_size = self.slot, self._launch_world_size
        elif self.slot not in plan.ranks:
            raise RecoveryError(f"rank {self.slot} is not in group {generation}")
        else:
            rank, world_size = plan.ranks[self.slot], plan.world_size
        before = socket_fds()
        dist.init_process_group(self.backend, store=dist.PrefixStore(keys.group_prefix(generation), self._store),
                                rank=rank, world_size=world_size, timeout=self.collective_timeout)
        with self._lock:
            self._group_fds = socket_fds() - before
            self.generation = generation

    def _break_group(self) -> None:
        """Shut the current group's connections down, so that every collective of it fails
        at once, on this rank and on each peer waiting for it.

        A survivor whose ring neighbours are alive would otherwise wait out the collective
        timeout: ``destroy_process_group`` does not close gloo's connections while anything
        (DDP, a failed work) still holds the group, and nothing can interrupt a wait from
        outside. torchft runs its groups in a subprocess it can kill for the same reason
        (``ProcessGroupBaby``); here the sockets the group opened are shut down instead.
        """
        with self._lock:
            for fd in self._group_fds:
                try:
                    sock = socket.socket(fileno=os.dup(fd))
                except OSError:
                    continue
                try:
                    # Not the listening socket: gloo's listener thread aborts the process on a failed accept.
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                finally:
                    sock.close()
            self._group_fds = set()

    def _recover(self) -> None:
        assert self._store is not None
        self._break_group()
        dist.destroy_process_group()
        plan = self._plan(self.generation + 1)
        latest = int(self._store.get(keys.LATEST_KEY))
        if latest != plan.generation:  # another rank was lost meanwhile: join the newest group
            plan = self._plan(latest)
        self._form(plan.generation, plan)
        self._transfer(plan, joining=False)

    # ----- state --------------------------------------------------------------------------

    def _transfer(self, plan: keys.Plan, joining: bool) -> None:
        """Agree on the step to continue from, send the state from the lowest rank there,
        and take this rank's RNG streams as they were after that step."""
        formed = time.time()
        self._follow_group()
        mine = torch.tensor([-1 if joining else self.step], dtype=torch.int64)
        steps = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(steps, mine)
        done = [int(step) for step in steps]
        step = min(s for s in done if s >= 0)
        source = done.index(step)
        # Did the step draw nothing from the RNG on any survivor (no dropout, say)? Then a lost
        # rank's streams after it are those after the step before.
        drew_nothing = torch.tensor([1 if joining or self._drew_nothing(step) else 0], dtype=torch.int64)
        dist.all_reduce(drew_nothing, op=dist.ReduceOp.MIN)
        self._load(broadcast_state(self._state() if dist.get_rank() == source else None, source))
        restore_rng(self._rng_after(step, joining, bool(drew_nothing.item())))
        self.step = step
        self._rng = {step: capture_rng()}
        if self._stop_agreement is not None:
            self._stop_agreement.continue_at(step)
        self._pending = {"plan": plan, "group_s": formed - plan.detected_at,
                         "transfer_s": time.time() - plan.detected_at}

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

    def _load(self, state: dict[str, Any]) -> None:
        for name, obj in self._objects().items():
            if isinstance(obj, ResumableSampler):  # dealt out over the new group
                obj.num_replicas, obj.rank = dist.get_world_size(), dist.get_rank()
            obj.load_state_dict(state["objects"][name])
        if self._checkpointer is not None:
            self._checkpointer.continue_from(state["checkpointer"])

    def _drew_nothing(self, step: int) -> bool:
        """This rank's streams after ``step`` are the same as after the step before."""
        return step - 1 in self._rng and step in self._rng and same_rng(self._rng[step - 1], self._rng[step])

    def _rng_after(self, step: int, joining: bool, drew_nothing: bool = False) -> dict[str, Any]:
        if not joining:
            if step not in self._rng:
                raise RecoveryError(f"rank {self.slot} has no RNG state of step {step}")
            return self._rng[step]
        assert self._store is not None
        saved_step, state = keys.rng_from_bytes(self._store.get(keys.rng_key(self.slot, step)))
        if saved_step == step:
            return state
        # Lost after its all-reduce of ``step`` and before its step_done: the copy of the step
        # before serves where the step drew nothing from the RNG on any survivor.
        saved_step, state = keys.rng_from_bytes(self._store.get(keys.rng_key(self.slot, step - 1)))
        if saved_step == step - 1 and drew_nothing:
            return state
        raise RecoveryError(f"the lost rank {self.slot} left no RNG streams of step {step} (it was lost after its "
                            f"all-reduce, and the step draws from the RNG)")

    def _keep_rng(self) -> None:
        state = capture_rng()
        self._rng = {s: kept for s, kept in self._rng.items() if s == self.step - 1}
        self._rng[self.step] = state
        if self._store is not None:
            self._store.set(keys.rng_key(self.slot, self.step), keys.rng_to_bytes(self.step, state))

    def _finish_recovery(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        plan: keys.Plan = pending["plan"]
        event = RecoveryEvent(generation=plan.generation, rank=plan.lost, host=plan.host, cause=plan.cause,
                              replaced=plan.replaced, world_size=plan.world_size, step=self.step - 1,
                              detected_at=plan.detected_at,
                              group_s=round(pending["group_s"], 4), transfer_s=round(pending["transfer_s"], 4),
                              recover_s=round(time.time() - plan.detected_at, 4))
        self.recoveries.append(event)
        if dist.get_rank() == 0:
            assert self._store is not None
            self._store.set(keys.recovered_key(plan.generation), "1")  # the launch may start the next spare
            log.warning("recovered from the loss of rank %d (%s) in %.2f s: %d ranks, continuing after step %d",
                        event.rank, event.cause, event.recover_s, event.world_size, event.step)
            if self.run_dir is not None:
                write_recovery(self.run_dir, event)

    def _beat(self, address: str, interval_s: float) -> None:
        try:
            store = keys.connect(address, self.wait_s)
            while not self._stop.wait(interval_s):
                store.add(keys.alive_key(self.slot), 1)
                # A rank was lost: leave the old group even where no collective noticed it yet.
                if store.check([keys.LATEST_KEY]) and int(store.get(keys.LATEST_KEY)) > self.generation:
                    self._break_group()
        except (dist.DistError, RuntimeError, OSError):
            return  # the launch is gone: nothing to tell


def same_rng(a: Any, b: Any) -> bool:
    """Two ``capture_rng`` states are equal."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_rng(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_rng(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def broadcast_state(state: dict[str, Any] | None, source: int) -> dict[str, Any]:
    """``state`` of rank ``source`` on every rank: ``torch.save`` into bytes on the source,
    broadcast as a uint8 tensor (its size first), ``torch.load(weights_only=True)`` on the
    others (as every checkpoint is read: tensors and plain data only, no code runs)."""
    if dist.get_rank() == source:
        assert state is not None
        payload = state_to_tensor(state)
        dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=source)
        dist.broadcast(payload, src=source)
        return state
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=source)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=source)
    return state_from_tensor(payload)


def state_to_tensor(state: dict[str, Any]) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def state_from_tensor(payload: torch.Tensor) -> dict[str, Any]:
    from ddp_hpc.engine.checkpoint_files import unsupported_global

    try:
        return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    except pickle.UnpicklingError as exc:
        found = unsupported_global(exc) or "unreadable"
        raise RecoveryError(f"the state from the survivors holds an object other than tensors and plain data "
                            f"({found}): it is read with torch.load(weights_only=True), as checkpoints are; give "
                            "the sampler, the Checkpointer's objects and extras plain state") from None


def socket_fds() -> set[int]:
    """This process's open sockets (Linux; elsewhere none are known and a recovery waits
    for the collective timeout)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    fds = set()
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds


def refuse_sharded(model: nn.Module) -> None:
    """FSDP2 keeps each shard once: a lost rank's part is gone (issue 31 leaves it for later)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has it only where fully_shard was born
        from torch.distributed._composable.fsdp import FSDPModule

    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        raise UserError("in-job recovery covers DDP only: an FSDP2 model keeps each shard on one rank, so a lost "
                        "rank's part is gone; use --max-restarts (restart from the newest checkpoint)")


"""In-job recovery: a lost rank costs seconds, not a restart.

Under DDP every rank holds the whole model, optimizer state and its place in the data, so
a lost rank needs nothing from disk; a sharded (FSDP2) model goes back to snapshots each
rank and a buddy keep in node memory (``shards.py``). ``InJobRecovery`` starts the process group in place
of ``dist.init_process_group`` and runs the user's training function; when a collective
fails (gloo raises within milliseconds once a peer's connection closes; a frozen peer is
ended by the launch, which closes it):

1. each survivor clears what the broken step left (``broken_step.py``: gradients, FSDP2's
   step state, buffers the broken forward changed, a scaler's stages), and the survivors
   leave the broken group without exiting (over gloo its sockets shut down,
   then ``destroy_process_group``; over NCCL it is aborted, and each optimizer step
   refuses to apply what an abort cut short: ``fence.py``);
2. they wait for the launch's ``Plan`` of the next generation (``engine/recovery/store.py``):
   the same ranks with a replacement the launch started for the lost one, or, where the
   user allowed shrinking, the survivors only, numbered anew;
3. they form the new group on the store under a fresh prefix (the generation), as torchft
   does for each quorum (``torchft/process_group.py``, ``configure``);
4. the lowest rank at the lowest step every member completed sends model, optimizer,
   sampler position and step, and the objects and bookkeeping of the loop's
   ``Checkpointer`` (``torch.save`` into bytes, broadcast as uint8 tensors in pieces, read with
   ``torch.load(weights_only=True)``: only tensors and plain data travel); ranks one step
   ahead (they finished the failed step's all-reduce before the peer's loss reached them)
   go back to it (a member whose optimizer step was applied before a collective of the
   same step failed is never the source: see ``transfer_source``), and every rank takes
   its RNG streams as they were after that step: they
   are derived from the rank's base seed and the step (``step_done`` reseeds every stream
   with ``step_seed(base, step)``), so a replacement rebuilds the lost rank's from its base
   seed, which each rank leaves in the store once. Nothing of a step needs to have reached
   ``step_done`` for that: a rank lost anywhere in a step (after its all-reduce, in the
   work before ``step_done``, in a save) is recovered alike;
5. the loop's ``Checkpointer`` and ``StopAgreement`` are pointed at the new group (its
   rank 0 writes the checkpoints), DDP is wrapped anew on it and the training function is
   called again: it continues from the sampler's position, redoing the step that failed.

A replacement that dies while the group forms, or a second loss during a recovery, is one
more loss: the survivors leave the half-formed group and wait for the launch's next plan.
When the launch gives up (no recovery left), it says so in a last plan, and every survivor
ends at once (``RecoveryError``) for the restart in place.

No checkpoint is read and no completed step is lost. Unlike torchft (a quorum and a commit
vote every step), nothing is added to a DDP step but a reseed of the streams and a copy of
the model's buffers (BatchNorm's statistics; none in most models): the launch that started
the ranks sees which one ended, so no per-step agreement is needed.

This module holds ``InJobRecovery`` itself: the loop through losses (``run``), each step's
end (``step_done``) and a recovery's order (``_recover``); each of its parts is a module of
one role: ``membership.py`` (the launch's plans, forming each group), ``group_abort.py``
(leaving a broken group), ``transfer.py`` (which member sends, what travels, loading it),
``snapshot_keeping.py`` (a sharded model's snapshots and roll-back), ``refusals.py`` (what
``run`` refuses before the first step) and ``broken_step.py``.

Limits: the state is serialized whole on the sender (fine for models of a few GB on one
host). Without a launch that recovers (``ddp-hpc launch --recover``), a failure ends the
rank as before and the launcher restarts in place.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.contract import (
    RECOVERY_GENERATION_VAR,
    RECOVERY_SHRINK_VAR,
    RECOVERY_SPARE_VAR,
    RECOVERY_STORE_VAR,
    RECOVERY_WAIT_VAR,
    RENDEZVOUS_TIMEOUT_VAR,
    RESTART_COUNT_VAR,
    RUN_FOLDER_VAR,
)
from ddp_hpc.engine.recovery import store as keys
from ddp_hpc.device import NCCL_MONITORING_VAR
from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
from ddp_hpc.engine.liveness import Heartbeat
from ddp_hpc.engine.recovery.backends import backend_refusal
from ddp_hpc.engine.recovery.broken_step import StepStart, clear_broken_step
from ddp_hpc.engine.recovery.errors import RecoveryError
from ddp_hpc.engine.recovery.fence import StepFence
from ddp_hpc.engine.recovery.record import RecoveryEvent
from ddp_hpc.engine.recovery.shards import DEFAULT_REPLICAS, Snapshots, sharding_refusal, snapshot_root
from ddp_hpc.engine.rng import seed_for_step
from ddp_hpc.engine.stop_agreement import StopAgreement
from ddp_hpc.environment import resolve_env
from ddp_hpc.errors import RefusedOnRank
from ddp_hpc.startup.distributed import DistributedOptions, start_through_rendezvous
from ddp_hpc.startup.group_start import GroupStart
from ddp_hpc.startup.rendezvous import parse_timeout
from ddp_hpc.engine.recovery.group_abort import ABORTED_BACKENDS, GroupAbort, abort_refusal, is_collective_error
from ddp_hpc.engine.recovery.membership import Membership, spare_places
from ddp_hpc.engine.recovery.refusals import (group_refusal, is_sharded, run_refusal, schedule_refusal,
                                              sharded_run_refusal)
from ddp_hpc.engine.recovery.snapshot_keeping import SnapshotKeeping, snapshot_cadence
from ddp_hpc.engine.recovery.transfer import StateTransfer, broadcast_from_rank0

log = logging.getLogger(__name__)

T = TypeVar("T")


#: Seconds a rank waits for the next group to form when the launch does not say.
DEFAULT_WAIT_S = 120.0


class InJobRecovery(Membership, GroupAbort, StateTransfer, SnapshotKeeping):
    """Starts this rank's process group and keeps DDP training through a lost rank.

    ``backend``: ``gloo`` (CPU) or another ``torch.distributed`` backend. ``run_dir``: where
    each recovery is recorded (``record/``), on rank 0 of the new group. ``ddp_kwargs`` go
    to each ``DistributedDataParallel`` (``find_unused_parameters=True`` unless given: it
    keeps the bucket layout, hence the sums, the same across a re-wrap). ``collective_timeout_s``: how long a collective
    may wait for a silent peer before it fails.

    A sharded (FSDP2) model is kept through a lost rank by snapshots (``shards.py``): every
    ``snapshot_every`` steps (default ``$DDP_HPC_SNAPSHOT_EVERY``, else 1) each rank copies its
    shards to node-local memory and to ``snapshot_replicas - 1`` buddies ``snapshot_distance``
    ranks away (default: ``LOCAL_WORLD_SIZE``, the next host).

    The constructor reads its settings and refuses what cannot run; ``start`` (called by the
    constructor unless ``start=False``, else by ``run``) does the I/O: the group, the
    launch's store, a spare's wait and the heartbeat.
    """

    def __init__(self, backend: str = "gloo", *, run_dir: str | os.PathLike[str] | None = None,
                 ddp_kwargs: Mapping[str, Any] | None = None, collective_timeout_s: float = 300.0,
                 heartbeat_s: float = 0.25, snapshot_every: int | None = None,
                 snapshot_replicas: int = DEFAULT_REPLICAS, snapshot_distance: int | None = None,
                 environ: Mapping[str, str] | None = None, group_start: GroupStart | None = None,
                 start: bool = True) -> None:
        env = os.environ if environ is None else environ
        self.backend, self.run_dir = backend, Path(run_dir) if run_dir is not None else None
        self.slot = int(env.get("RANK", "0"))
        self._refuse_a_group_started_before()
        self.enabled = env.get(RECOVERY_STORE_VAR) is not None
        self.snapshot_every = snapshot_cadence(snapshot_every, env, self.slot)
        self._snapshot_replicas = snapshot_replicas
        self._snapshot_distance = snapshot_distance
        self._local_world_size = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
        self._shrinks = env.get(RECOVERY_SHRINK_VAR) == "1"
        self._restarts = int(env.get(RESTART_COUNT_VAR, "0") or 0)
        self._snapshot_root = snapshot_root(run_dir if run_dir is not None else env.get(RUN_FOLDER_VAR), env)
        self._snapshots: Snapshots | None = None
        if self.enabled and (why := backend_refusal(backend)) is not None:
            raise RefusedOnRank(why, self.slot)
        available = getattr(dist, "is_backend_available", None)  # torch >= 2.4
        if available is not None and not available(backend):
            raise RefusedOnRank(f"InJobRecovery({backend!r}): this torch ({torch.__version__}) has no {backend} "
                                f"backend", self.slot)
        if self.enabled and (why := abort_refusal(backend, env)) is not None:
            raise RefusedOnRank(why, self.slot)
        if self.enabled and backend in ABORTED_BACKENDS and env.get(NCCL_MONITORING_VAR, "0").strip() != "0":
            log.warning("rank %d: %s=%s: a replacement's NCCL monitor may end it minutes after it joins (it reads the "
                        "dump request a survivor's watchdog leaves in the launch's store); the launch sets it to 0",
                        self.slot, NCCL_MONITORING_VAR, env.get(NCCL_MONITORING_VAR))
        #: Each step's check that its group was not aborted meanwhile (NCCL; see fence.py).
        self._fence = (StepFence(ABORTED_BACKENDS[backend], collective_timeout_s)
                       if self.enabled and backend in ABORTED_BACKENDS else None)
        #: The group formed last, for the heartbeat's thread to abort (NCCL), and that abort.
        self._group: Any = None
        self._aborting: threading.Thread | None = None
        # A DDP that rebuilds its buckets after its first step lays the gradients out anew, and
        # gloo's ring then sums some of them in another order: the step after a re-wrap would
        # differ in the last bits from the same step without a recovery. With
        # find_unused_parameters the buckets are never rebuilt (the reducer's
        # should_rebuild_buckets), so every wrap sums in the same order.
        self.ddp_kwargs = {"find_unused_parameters": True, **(ddp_kwargs or {})}
        self.collective_timeout = timedelta(seconds=collective_timeout_s)
        self._environ = environ
        #: How each group is initialised: ``process_group()``'s settings, else decided once, as it would.
        self._group_start = group_start
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
        #: The base of this slot's streams (``step_seed``): set in ``run``.
        self.seed: int | None = None
        self._repeated = 0
        self._pending: dict[str, Any] | None = None
        #: A DDP model's buffers at the last step's end, and whether this step's optimizer step was applied.
        self._step_start = StepStart()
        self._keeps_buffers = False
        self._has_buffers = False
        self._lock = threading.Lock()
        self._group_fds: set[int] = set()
        #: The slots of the group formed last (its members' heartbeats are the ones a watchdog reads).
        self._slots: tuple[int, ...] = tuple(range(self._launch_world_size))
        self._heartbeat: Heartbeat | None = None
        self._heartbeat_s = heartbeat_s
        self._address: str | None = address
        self._store: dist.Store | None = None
        #: ``start`` was called (and may have formed a group), and it ended without an error.
        self._start_called = self._started = False
        self._start_error: BaseException | None = None
        if start:
            self.start()

    def _refuse_a_group_started_before(self) -> None:
        if (why := group_refusal()) is not None:
            # Ended first: left to the interpreter's exit, a live gloo group can abort the process.
            dist.destroy_process_group()
            raise RefusedOnRank(why, self.slot)

    def start(self) -> InJobRecovery:
        """Form this rank's process group (the constructor's ``start=True`` calls it; with
        ``start=False`` the constructor only reads its settings, and ``start()`` or ``run`` does
        this): without ``--recover``, through the rendezvous, as ``dist.init_process_group``
        would; under it, connect to the launch's store, wait there as a spare until a lost rank's
        place is given (``slot`` is then that rank's), form the newest group and start the
        heartbeat. Once per object; returns it. Until it returns, a spare's ``slot`` and
        ``joining`` are those it was started with; a start that failed raises the same error
        again (what it formed is not formed twice)."""
        if self._started:
            return self
        if self._start_error is not None:
            raise self._start_error
        self._start_called = True
        try:
            self._start()
        except BaseException as exc:
            self._start_error = exc
            raise
        self._started = True
        return self

    def _start(self) -> None:
        env = os.environ if self._environ is None else self._environ
        self._refuse_a_group_started_before()
        address = self._address
        if address is None:
            log.warning("in-job recovery is off (not started by `ddp-hpc launch --recover`): a lost rank ends "
                        "the job and the launcher restarts it in place")
            start_through_rendezvous(self._settings(), resolve_env(env), env,
                                     parse_timeout(env.get(RENDEZVOUS_TIMEOUT_VAR),
                                                   DistributedOptions().rendezvous_timeout_s))
            return
        self._store = keys.connect(address, self.wait_s)
        spare = env.get(RECOVERY_SPARE_VAR)
        if spare is not None:
            self.slot = self._wait_as_spare(spare)
            self.generation = int(self._store.get(keys.LATEST_KEY))
            places = spare_places(env, self.slot)
            if self._environ is None:  # from here on this process is the rank it replaces, to the script too
                os.environ.update(places)
            else:
                self._environ = {**self._environ, **places}
            if self._group_start is not None:  # decided before it had a place: the device moves with it
                self._group_start = self._group_start.for_local_rank(int(places["LOCAL_RANK"]),
                                                                     self._local_world_size or 1, self._environ)
        if self.generation:  # a replacement: the group of the newest plan
            self._form_newest(self._plan(self.generation))
        else:
            self._form(0, None)
        # The rank's one heartbeat (liveness.Heartbeat): the launch's hang detector reads it, a
        # watchdog given it (``heartbeat``) reports through it, and each beat looks for a newer plan.
        self._heartbeat = keys.heartbeat(address, self.slot, lambda: self._slots, self._on_beat, self._heartbeat_s,
                                         self.wait_s)
        self._heartbeat.start()
        # Stopped before the interpreter (or the script runner) ends the group: a beat thread
        # inside a store call while the interpreter finalizes aborts the process (SIGABRT,
        # seen after a one-line refusal raised by another part, which reads as a lost rank).
        atexit.register(self._heartbeat.stop, self.wait_s)
        self._store.set(keys.ready_key(self.slot), "1")

    # ----- the user's loop --------------------------------------------------------------

    @property
    def heartbeat(self) -> Heartbeat | None:
        """This rank's heartbeat in the launch's store (None without ``--recover``): give it to
        a watchdog, ``ddp_hpc.watchdog(limit_s, heartbeat=recovery.heartbeat)``, which then
        reports through it and names the silent ranks by slot, with no second thread."""
        return self._heartbeat

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
        self.start()
        sharded = is_sharded(model)
        why = (sharded_run_refusal(model, optimizer, wrap)
               or run_refusal(model, checkpointer, shrinks=self.enabled and self._shrinks))
        if why is None and self._fence is not None and type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            why = (f"ZeroRedundancyOptimizer cannot recover over {self.backend}: its parameter broadcasts after the "
                   "step could be cut short by an abort unseen; use a plain optimizer (or FSDP2) under --recover")
        if why is None and sharded and self.enabled:
            why = sharding_refusal(model)
        if why is None and self.enabled:
            why = schedule_refusal(optimizer, checkpointer)
        if why is not None:  # the same on every rank: each exits 2, and the launch spends no recovery on it
            # The group and the heartbeat end first: left to the interpreter's exit, a live gloo
            # group's threads can abort the process (SIGABRT, seen), which reads as a lost rank.
            self.close()
            raise RefusedOnRank(why, self.slot)
        self._model, self._optimizer, self._sampler = model, optimizer, sampler
        self._checkpointer, self._stop_agreement = checkpointer, stop
        if checkpointer is not None and self._counted not in checkpointer.step_listeners:
            checkpointer.step_listeners.append(self._counted)  # the loop may call either step_done
        if checkpointer is not None:
            self.step = checkpointer.step  # a restored checkpoint's step
        self.seed = self._base_seed()
        self._keeps_buffers = self.enabled and not sharded  # a sharded model's come back with its snapshot
        self._has_buffers = any(True for _ in model.buffers())
        self._follow_group()
        if sharded and self.enabled:
            self._start_snapshots(checked=self.joining)
        if self.joining:
            self._join_next(self._plan(self.generation), joining=True)
        else:
            seed_for_step(self.seed, self.step)
            if self._snapshots is not None and self._restarts > 0:
                self._resume_from_memory()
        saving = (lambda: checkpointer.saving) if checkpointer is not None else (lambda: False)
        hooks = [self._step_start.attach(optimizer, ignore=saving)]
        if self._keeps_buffers:
            self._step_start.keep(model)
            hooks.append(self._step_start.watch(model, lambda: self.step))
            if self._has_buffers:  # before the fence's pre-hook, which then waits for its broadcast too
                hooks.append(self._step_start.share(optimizer, model, lambda: self.step, broadcast_from_rank0,
                                                    ignore=saving))
        if self._fence is not None:
            hooks.append(self._fence.attach(optimizer, ignore=saving))
        try:
            return self._train_through_losses(train, model, checkpointer, wrap, sharded)
        finally:
            for hook in hooks:
                hook.remove()

    def _train_through_losses(self, train: Callable[[nn.Module], T], model: nn.Module,
                              checkpointer: Checkpointer | None,
                              wrap: Callable[[nn.Module], DistributedDataParallel] | None, sharded: bool) -> T:
        recovered = self.joining  # every member of a new group makes the broken save again, a replacement too
        while True:
            wrapped = None
            try:
                if recovered and checkpointer is not None:  # a save the loss broke (a no-op where it was done)
                    checkpointer.save_due()
                # Inside the try: DDP's constructor checks the parameters with a collective,
                # which fails like any other when a peer is lost while the group is new.
                if wrap is not None:
                    wrapped = wrap(model)
                else:  # a sharded model is its own wrapper (FSDP2 shards in place)
                    wrapped = model if sharded else DistributedDataParallel(model, **self.ddp_kwargs)
                self._step_start.forward_receives = (bool(getattr(wrapped, "broadcast_buffers", False))
                                                     and self._fence is None)
                result = train(wrapped)
                self._end_snapshots()
                return result
            except RuntimeError as exc:  # DistError and GroupAborted are ones
                if not (self.enabled and is_collective_error(exc)):
                    raise
                log.warning("rank %d: a collective failed (%s): recovering in the job", self.slot,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            # DDP holds the broken group: free it (it sits in a reference cycle) before leaving.
            del wrapped
            gc.collect()
            self._recover()
            recovered = True

    def step_done(self, batches: int = 1, *, epoch_ends: bool = False, save: bool = True) -> None:
        """One optimizer step is complete on this rank. With the ``checkpointer`` given to
        ``run`` this is its ``step_done``, the same call: it counts the step and advances its
        samplers, this rank's part follows as its step listener, then its cadence's save. A
        loop calls one of the two. This rank's part: count the step, advance a sampler the
        Checkpointer does not hold, reseed this rank's streams for the next step
        (``step_seed(seed, step)``: torch's, every accelerator's, numpy's and Python's, so
        that whoever replaces it can rebuild them) and, for a sharded model, take the
        snapshot at its cadence.
        ``epoch_ends`` and ``save`` as in ``Checkpointer.step_done`` (``save=False``: the
        caller calls ``checkpointer.save_due()`` itself, once the step's other bookkeeping,
        its callbacks say, is done). Over NCCL a step the group was aborted in raises
        ``GroupAborted`` here, before anything is counted (see ``fence.py``)."""
        if self._fence is not None:
            self._fence.step_ended()
        if self._checkpointer is not None:
            self._checkpointer.step_done(batches, epoch_ends=epoch_ends, save=save)
        else:
            self._counted(batches)

    def _counted(self, batches: int) -> None:
        """This rank's part of a step's end (see ``step_done``); a save after it is a
        collective: a peer lost in it is recovered from this step on."""
        self.step += 1
        if self._sampler is not None and not self._advanced_by_checkpointer(self._sampler):
            self._sampler.advance(batches)
        if self.seed is None:  # step_done outside run(): the streams' base is the seed the script set
            self.seed = torch.initial_seed()
        seed_for_step(self.seed, self.step)
        self._step_start.applied = False
        if self._keeps_buffers and self._model is not None:
            self._step_start.keep(self._model)
            if self._has_buffers:
                self._step_start.counted(self.step)
        if self._snapshots is not None and self._snapshots.due(self.step):
            self._snapshots.take(self.step)
        if self._pending is not None:
            self._finish_recovery()

    def close(self) -> None:
        """Stops the heartbeat (the launch no longer watches this rank) and ends the process group."""
        if self._store is not None:
            self._store.delete_key(keys.ready_key(self.slot))
        if self._heartbeat is not None:  # not left inside a store call when the interpreter ends
            self._heartbeat.stop(timeout_s=self.wait_s)
        if self._start_called and dist.is_initialized():  # a group it formed, not one of before
            dist.destroy_process_group()

    # ----- forming a group --------------------------------------------------------------


    def _recover(self) -> None:
        assert self._model is not None
        clear_broken_step(self._model, self._optimizer, self._objects().values(), sharded=self._snapshots is not None,
                          step_start=self._step_start if self._keeps_buffers else None)
        self._leave_group()
        self._join_next(self._plan(self.generation + 1), joining=False)

    def _join_next(self, plan: keys.Plan, joining: bool) -> None:
        """Form the group of ``plan`` (or of a newer one) and take the state. A member lost
        meanwhile (a replacement that dies starting, a second loss) fails the forming or the
        transfer: that is one more loss, and the launch's next plan follows."""
        while True:
            if plan.generation != self.generation or not dist.is_initialized():
                plan = self._form_newest(plan)
            try:
                self._transfer(plan, joining=joining)
                return
            except RecoveryError as exc:
                if dist.is_initialized() and dist.get_rank() == 0 and self._store is not None:
                    keys.give_up(self._store, str(exc).split(": ", 1)[-1])  # the launch gives up at the exits
                raise
            except RuntimeError as exc:  # DistError is one
                self._failed(plan, exc)
            plan = self._plan(plan.generation + 1)


    # ----- snapshots of a sharded model -------------------------------------------------


    # ----- state --------------------------------------------------------------------------


    def _on_beat(self, store: dist.Store) -> None:
        """After each heartbeat, on its thread: a rank was lost, so leave the old group even
        where no collective noticed it yet. A store error ends this beat only (the heartbeat
        connects again); no lock is held while the store is asked."""
        latest = keys.latest(store)
        if latest > self.generation:
            self._break_group(older_than=latest)
        elif self._fence is not None and self._fence.overdue():
            log.warning("rank %d: a step's collectives did not finish within the collective timeout (%g s): "
                        "aborting the group", self.slot, self.collective_timeout.total_seconds())
            self._break_group()



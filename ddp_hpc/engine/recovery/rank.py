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

Limits: the state is serialized whole on the sender (fine for models of a few GB on one
host). Without a launch that recovers (``ddp-hpc launch --recover``), a failure ends the
rank as before and the launcher restarts in place.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
    SNAPSHOT_EVERY_VAR,
)
from ddp_hpc.engine.recovery import store as keys
from ddp_hpc.device import NCCL_ERROR_HANDLING_VAR, NCCL_MONITORING_VAR
from ddp_hpc.engine import sharding
from ddp_hpc.engine.checkpointer import Checkpointer
from ddp_hpc.engine.group import ProcessGroupView
from ddp_hpc.engine.liveness import Heartbeat
from ddp_hpc.engine.recovery.backends import backend_refusal
from ddp_hpc.engine.recovery.broken_step import StepStart, clear_broken_step, load_buffers
from ddp_hpc.engine.recovery.errors import GroupAborted, RecoveryError, Superseded
from ddp_hpc.engine.recovery.fence import StepFence, wait_for_stream
from ddp_hpc.engine.recovery.layout import describe_lost_together, node_bytes
from ddp_hpc.engine.recovery.payload import PIECE_BYTES, pieces, state_from_tensor, state_to_tensor
from ddp_hpc.engine.recovery.record import (
    RecoveryEvent,
    ResumeEvent,
    SnapshotPlan,
    write_recovery,
    write_resume,
    write_snapshot_plan,
)
from ddp_hpc.engine.recovery.shards import (
    DEFAULT_REPLICAS,
    KEPT_STEPS,
    Buddies,
    Rollback,
    SnapshotFiles,
    Snapshots,
    SwapLink,
    available_memory_bytes,
    fetch_own,
    gather_json,
    newest_common,
    rebind,
    restored_dtensors,
    sharding_refusal,
    snapshot_root,
    localized,
    state_bytes,
)
from ddp_hpc.engine.rng import seed_for_step
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.engine.stop_agreement import StopAgreement
from ddp_hpc.environment import resolve_env
from ddp_hpc.errors import RefusedOnRank, UserError
from ddp_hpc.startup.distributed import DistributedOptions, start_through_rendezvous
from ddp_hpc.startup.group_start import GroupStart
from ddp_hpc.startup.rendezvous import parse_timeout

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_collective_error(exc: BaseException) -> bool:
    """A collective failed because a peer is gone: torch's ``DistError``s, the plain
    ``RuntimeError`` gloo raises from its transport ("[.../gloo/transport/tcp/pair.cc:553]
    Connection closed by peer"), and a step refused because its group was aborted
    (``GroupAborted``, NCCL). Any other error is the user's and ends the rank as before."""
    return (isinstance(exc, (dist.DistError, GroupAborted))
            or (isinstance(exc, RuntimeError) and "gloo/transport" in str(exc)))

#: The backends whose collectives finish on a device stream: a broken group of theirs is
#: aborted, and each step passes a ``StepFence``.
ABORTED_BACKENDS = {"nccl": "cuda"}

#: Seconds a rank waits for the next group to form when the launch does not say.
DEFAULT_WAIT_S = 120.0
#: The Checkpointer's rank extra that keeps a rank's base seed across a restart.
STREAM_SEED = "stream_seed"
#: Steps between snapshots of a sharded model when neither the caller nor the launch says.
DEFAULT_SNAPSHOT_EVERY = 1


class InJobRecovery:
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
    """

    def __init__(self, backend: str = "gloo", *, run_dir: str | os.PathLike[str] | None = None,
                 ddp_kwargs: Mapping[str, Any] | None = None, collective_timeout_s: float = 300.0,
                 heartbeat_s: float = 0.25, snapshot_every: int | None = None,
                 snapshot_replicas: int = DEFAULT_REPLICAS, snapshot_distance: int | None = None,
                 environ: Mapping[str, str] | None = None, group_start: GroupStart | None = None) -> None:
        env = os.environ if environ is None else environ
        self.backend, self.run_dir = backend, Path(run_dir) if run_dir is not None else None
        self.slot = int(env.get("RANK", "0"))
        if (why := group_refusal()) is not None:
            # Ended first: left to the interpreter's exit, a live gloo group can abort the process.
            dist.destroy_process_group()
            raise RefusedOnRank(why, self.slot)
        self.enabled = env.get(RECOVERY_STORE_VAR) is not None
        self.snapshot_every = _snapshot_every(snapshot_every, env, self.slot)
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
        self._lock = threading.Lock()
        self._group_fds: set[int] = set()
        #: The slots of the group formed last (its members' heartbeats are the ones a watchdog reads).
        self._slots: tuple[int, ...] = tuple(range(self._launch_world_size))
        self._heartbeat: Heartbeat | None = None
        if address is None:
            log.warning("in-job recovery is off (not started by `ddp-hpc launch --recover`): a lost rank ends "
                        "the job and the launcher restarts it in place")
            dist_env = resolve_env(env)
            start_through_rendezvous(self._settings(), dist_env, env,
                                     parse_timeout(env.get(RENDEZVOUS_TIMEOUT_VAR),
                                                   DistributedOptions().rendezvous_timeout_s))
            self._store: dist.Store | None = None
            self._address: str | None = None
            return
        self._address = address
        self._store = keys.connect(address, self.wait_s)
        spare = env.get(RECOVERY_SPARE_VAR)
        if spare is not None:
            self.slot = self._wait_as_spare(spare)
            self.generation = int(self._store.get(keys.LATEST_KEY))
            places = spare_places(env, self.slot)
            if environ is None:  # from here on this process is the rank it replaces, to the script too
                os.environ.update(places)
            else:
                self._environ = {**environ, **places}
            if self._group_start is not None:  # decided before it had a place: the device moves with it
                self._group_start = self._group_start.for_local_rank(int(places["LOCAL_RANK"]),
                                                                     self._local_world_size or 1, self._environ)
        if self.generation:  # a replacement: the group of the newest plan
            self._form_newest(self._plan(self.generation))
        else:
            self._form(0, None)
        # The rank's one heartbeat (liveness.Heartbeat): the launch's hang detector reads it, a
        # watchdog given it (``heartbeat``) reports through it, and each beat looks for a newer plan.
        self._heartbeat = keys.heartbeat(address, self.slot, lambda: self._slots, self._on_beat, heartbeat_s,
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
        sharded = is_sharded(model)
        why = (sharded_run_refusal(model, optimizer, wrap)
               or run_refusal(model, checkpointer, shrinks=self.enabled and self._shrinks))
        if why is None and self._fence is not None and type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            why = (f"ZeroRedundancyOptimizer cannot recover over {self.backend}: its parameter broadcasts after the "
                   "step could be cut short by an abort unseen; use a plain optimizer (or FSDP2) under --recover")
        if why is None and sharded and self.enabled:
            why = sharding_refusal(model)
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
        if self._fence is not None:
            hooks.append(self._fence.attach(optimizer))
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
        if dist.is_initialized():
            dist.destroy_process_group()

    # ----- forming a group --------------------------------------------------------------

    def _plan(self, generation: int) -> keys.Plan:
        assert self._store is not None
        try:
            plan = keys.wait_plan(self._store, generation, self.wait_s)
        except (dist.DistStoreError, RuntimeError) as exc:
            raise RecoveryError(f"rank {self.slot}: no new group from the launch within {self.wait_s:g} s "
                                f"({RECOVERY_WAIT_VAR}); the launch restarts the job in place") from exc
        if plan.gave_up:
            raise RecoveryError(f"rank {self.slot}: the launch gave up in-job recovery after losing rank {plan.lost} "
                                f"({plan.cause}); it restarts the job in place")
        return plan

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
            self._await_members(plan)
        settings = self._settings()
        before = socket_fds()
        try:
            settings.init(dist.PrefixStore(keys.group_prefix(generation), self._store), rank, world_size)
        except BaseException:  # a group that failed to form leaves its sockets to be shut down too
            with self._lock:
                self._group_fds = socket_fds() - before if self._fence is None else set()
            raise
        # The group (its sockets, or itself for an abort) and its generation change together:
        # the heartbeat, which breaks groups older than the newest plan, never takes the new
        # group for the old.
        with self._lock:
            self._group_fds = socket_fds() - before if self._fence is None else set()
            self._group = dist.group.WORLD
            if self._fence is not None:
                self._fence.reset()
            self.generation = generation
            self._slots = tuple(sorted(plan.ranks, key=plan.ranks.__getitem__)) if plan is not None else self._slots

    def _settings(self) -> GroupStart:
        """The start-up every group of this rank shares (decided on the first group: a warm
        spare's place in the job is known only then)."""
        if self._group_start is None:
            try:
                self._group_start = GroupStart.for_this_rank(self.backend, self.collective_timeout, self._environ)
            except UserError as exc:  # no device for this rank: the same on every start, no loss
                raise RefusedOnRank(str(exc), self.slot) from None
        return self._group_start

    def _await_members(self, plan: keys.Plan) -> None:
        """Every member of ``plan`` has come to form it, before any connects: a member that
        died starting (a replacement) would otherwise hold the others in torch's rendezvous
        for the collective timeout. The last to come says so in the store; so does the
        launch when it publishes a newer plan (it saw that death), which ends the wait."""
        assert self._store is not None
        joined = keys.joined_key(plan.generation)
        if int(self._store.add(joined, 1)) == plan.world_size:
            self._store.set(keys.formed_key(plan.generation), "1")
        try:
            self._store.wait([keys.formed_key(plan.generation)], timedelta(seconds=self.wait_s))
        except (dist.DistStoreError, RuntimeError) as exc:
            raise RecoveryError(f"rank {self.slot}: group {plan.generation} did not gather its {plan.world_size} "
                                f"members within {self.wait_s:g} s ({RECOVERY_WAIT_VAR})") from exc
        if int(self._store.add(joined, 0)) < plan.world_size:
            raise Superseded(f"group {plan.generation} lost a member before it formed")

    def _break_group(self, older_than: int | None = None) -> None:
        """Shut the current group's connections down, so that every collective of it fails
        at once, on this rank and on each peer waiting for it.

        A survivor whose ring neighbours are alive would otherwise wait out the collective
        timeout: ``destroy_process_group`` does not close gloo's connections while anything
        (DDP, a failed work) still holds the group, and nothing can interrupt a wait from
        outside. torchft runs its groups in a subprocess it can kill for the same reason
        (``ProcessGroupBaby``); here the sockets the group opened are shut down instead.
        An NCCL group is aborted (its communicators, torch's ``ProcessGroup.abort``, as
        torchft leaves one), its fence marked first (``fence.py``).
        ``older_than``: only a group of an older generation (the heartbeat's view).
        """
        with self._lock:
            if older_than is not None and self.generation >= older_than:
                return
            if self._fence is not None:
                if self._group is not None and not self._fence.aborted:
                    self._fence.mark_aborted()
                    # On a thread of its own: an abort may take seconds, and the heartbeat
                    # that calls this must go on beating meanwhile.
                    self._aborting = threading.Thread(target=abort_group, args=(self._group, self.slot), daemon=True,
                                                      name="ddp_hpc-group-abort")
                    self._aborting.start()
                return
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

    def _form_newest(self, plan: keys.Plan) -> keys.Plan:
        """Form the group of ``plan``, or of the newest plan where the launch published a
        newer one meanwhile or one comes while this one forms; the plan formed."""
        assert self._store is not None
        while True:
            latest = int(self._store.get(keys.LATEST_KEY))
            if latest > plan.generation:  # another rank was lost meanwhile: join the newest group
                plan = self._plan(latest)
            try:
                self._form(plan.generation, plan)
                return plan
            except RecoveryError:
                raise
            except RuntimeError as exc:  # Superseded; gloo's failed connect to a member that died
                self._failed(plan, exc)
            plan = self._plan(plan.generation + 1)

    def _failed(self, plan: keys.Plan, exc: BaseException) -> None:
        log.warning("rank %d: group %d failed before training went on (%s): waiting for the next plan", self.slot,
                    plan.generation, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        self._leave_group()

    def _leave_group(self) -> None:
        self._break_group()
        with self._lock:
            self._group, aborting, self._aborting = None, self._aborting, None
        if aborting is not None:  # one abort at a time: torch's below aborts the group too
            aborting.join(self.collective_timeout.total_seconds())
            if aborting.is_alive():
                raise RecoveryError(f"rank {self.slot}: aborting the broken group did not end within the collective "
                                    f"timeout ({self.collective_timeout.total_seconds():g} s); the launch restarts "
                                    "the job in place")
        if dist.is_initialized():
            # The group's destructor joins gloo's worker threads, and one that an op of the
            # broken group still holds (seen with rank 0 lost) keeps it until the collective
            # timeout: the last reference is dropped on a thread of its own, so this rank
            # goes on to the next group at once.
            held = [dist.group.WORLD]
            if self._fence is not None:
                # An aborted NCCL group is let go without a shutdown: that joins its watchdog,
                # which may sleep a minute dumping its trace after a peer's error.
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
            threading.Thread(target=held.clear, daemon=True, name="ddp_hpc-broken-group-release").start()

    # ----- snapshots of a sharded model -------------------------------------------------

    def _start_snapshots(self, checked: bool) -> None:
        """Buddies on other hosts, room on each node for its ranks' copies (said, else
        refused on every rank alike, before the first step), and the group copies travel on.
        ``checked``: a replacement, whose group passed the checks at its start (its group's
        collectives come in the state transfer)."""
        world = dist.get_world_size()
        distance = self._snapshot_distance
        if distance is None:  # the next host's rank in the same place; one host: the next rank
            distance = self._local_world_size if 0 < self._local_world_size < world else 1
        buddies = Buddies(world_size=world, distance=distance, replicas=self._snapshot_replicas)
        files = SnapshotFiles(self._snapshot_root)
        if checked:
            self._snapshots = Snapshots(self.snapshot_every, buddies, files, self._state)
            return
        mine = {"host": socket.gethostname(), "payload": snapshot_bytes(self._state()),
                "free": available_memory_bytes(files.root)}
        everyone = gather_json(mine, self._check_group)
        hosts = [one["host"] for one in everyone]
        payloads = [one["payload"] for one in everyone]
        held = node_bytes(hosts, payloads, buddies)
        at_most = node_bytes(hosts, payloads, buddies, steps=KEPT_STEPS + 1)
        why = buddies.refusal(hosts) or memory_refusal(everyone, at_most, buddies, files.root)
        if why is not None:
            self.close()
            raise RefusedOnRank(why, self.slot)
        if len(set(hosts)) == 1 and world > 1 and self.slot == 0:
            log.warning("rank %d: every rank runs on %s: the snapshots survive a lost rank, not a lost host",
                        self.slot, hosts[0])
        self._snapshots = Snapshots(self.snapshot_every, buddies, files, self._state)
        self._attach_snapshots()
        if self.slot == 0:
            assert self._store is not None
            keys.publish_snapshots(self._store, world, buddies.distance, buddies.replicas, str(files.root))
            self._say_snapshot_memory(hosts, payloads, held, buddies, files)

    def _say_snapshot_memory(self, hosts: list[str], payloads: list[int], held: dict[str, int], buddies: Buddies,
                             files: SnapshotFiles) -> None:
        """rank 0's line on what the snapshots take of its node's memory, and the plan in the record."""
        here = hosts[0]
        ranks_here = hosts.count(here)
        slots = buddies.slots_on_host(hosts, here)
        in_files = KEPT_STEPS * sum(payloads[slot] for slot in slots)
        log.info("snapshots of the sharded state every %d step(s) in %s, each also held %d rank(s) away: about %.1f "
                 "MiB of node-local memory per rank (%.1f MiB of files: %d steps of the %d slots whose copies %s "
                 "keeps; %.1f MiB of host buffers)", self.snapshot_every, files.root, buddies.distance,
                 held[here] / ranks_here / 2**20, in_files / ranks_here / 2**20, KEPT_STEPS, len(slots), here,
                 (held[here] - in_files) / ranks_here / 2**20)
        if self.run_dir is not None:
            write_snapshot_plan(self.run_dir, SnapshotPlan(
                every=self.snapshot_every, replicas=buddies.replicas, distance=buddies.distance,
                kept_steps=KEPT_STEPS, folder=str(files.root),
                bytes_per_rank={str(rank): held[host] // hosts.count(host) for rank, host in enumerate(hosts)},
                snapshot_bytes={str(rank): payload for rank, payload in enumerate(payloads)},
                node_bytes=held,
                file_bytes={one: KEPT_STEPS * sum(payloads[slot] for slot in buddies.slots_on_host(hosts, one))
                            for one in dict.fromkeys(hosts)}))

    def _attach_snapshots(self) -> None:
        """The swaps of the group formed last meet under its generation's prefix."""
        assert self._snapshots is not None and self._address is not None
        self._snapshots.attach(SwapLink(address=self._address, prefix=f"{keys.group_prefix(self.generation)}snapshots-{self._restarts}/",
                                        rank=dist.get_rank(), world_size=dist.get_world_size(),
                                        group_start=self._settings()))

    def _kept_slots(self) -> list[int]:
        assert self._snapshots is not None
        return [self.slot, *self._snapshots.buddies.held_by(self.slot)]

    def _roll_back(self) -> Rollback:
        """Every member goes back to the newest snapshot every shard has: its own copy, or
        (a replacement) the lost rank's from a buddy. A survivor cleared what the broken step
        left first (``_recover``)."""
        snapshots, model = self._snapshots, self._model
        assert snapshots is not None and model is not None
        rebind(model)
        self._attach_snapshots()
        rollback = self._load_newest_snapshot()
        if rollback is None:
            cause = self._no_rollback_cause()
            if dist.get_rank() == 0 and self._store is not None:  # the launch gives up at the survivors' exits
                keys.give_up(self._store, cause)
            raise RecoveryError(f"rank {self.slot}: {cause}; the launch restarts the job in place from the newest "
                                "checkpoint")
        return rollback

    def _no_rollback_cause(self) -> str:
        """Why no snapshot step is held for every shard (one clause, the same on every member):
        a rank lost with every buddy that held its copies (their nodes' memory with them), or
        a loss before any copy was kept."""
        snapshots = self._snapshots
        assert snapshots is not None
        held = gather_json(sorted(int(slot) for slot in snapshots.files.holdings(self._kept_slots())),
                           self._check_group)
        kept = {slot for slots in held for slot in slots}
        missing = [slot for slot in range(dist.get_world_size()) if slot not in kept]
        if not kept:
            return "no snapshot was kept yet (the loss came before the first one)"
        if missing:
            gone = snapshots.buddies.gone_together(missing) or [(missing[0], snapshots.buddies.holders(missing[0]))]
            return describe_lost_together(gone)
        return "the shards' copies are of different steps, none held for every shard"

    def _load_newest_snapshot(self) -> Rollback | None:
        """Load the newest snapshot step every shard has, whoever holds it; its rollback."""
        snapshots = self._snapshots
        assert snapshots is not None
        held = snapshots.files.holdings(self._kept_slots())
        reports = gather_json({"held": {str(slot): steps for slot, steps in held.items()}, "step": self.step},
                              self._check_group)
        rollback = newest_common([report["held"] for report in reports])
        if rollback is None:
            return None
        rollback = dataclasses.replace(rollback, redone=max(report["step"] for report in reports) - rollback.step)
        self._load(state_from_tensor(fetch_own(rollback, snapshots.files, ProcessGroupView.current().device,
                                               self._check_group)), shrunk=False)
        for slot in self._kept_slots():
            snapshots.files.drop_after(slot, rollback.step)  # steps that are done again
        return rollback

    def _resume_from_memory(self) -> None:
        """A restart in place: the newest snapshot the nodes kept, where it is newer than
        the checkpoint the loop restored; which one it was goes to the log and the record."""
        from_disk = self.step
        rollback = self._load_newest_snapshot() if self._snapshots is not None else None
        memory = rollback is not None and rollback.step > from_disk
        if rollback is not None and not memory:  # older than the disk's: the disk's state stands
            log.info("rank %d: the node-local snapshot (step %d) is not newer than the checkpoint", self.slot,
                     rollback.step)
        if memory:
            assert rollback is not None and self.seed is not None
            self.step = rollback.step
            seed_for_step(self.seed, self.step)
            if self._stop_agreement is not None:
                self._stop_agreement.continue_at(self.step)
        event = ResumeEvent(restart=self._restarts, tier="memory" if memory else "disk", step=self.step,
                            checkpoint_step=from_disk, from_buddies=_from_buddies(rollback) if memory else ())
        if dist.get_rank() == 0:
            log.warning("restarted in place (restart %d) from the %s at step %d", event.restart,
                        "node-local snapshot" if memory else "checkpoint on disk", event.step)
            if self.run_dir is not None:
                write_resume(self.run_dir, event)

    def _end_snapshots(self) -> None:
        """Training ended on this rank: its node-local copies are not needed any more."""
        if self._snapshots is not None:
            try:  # every rank's last swap is done before any removes what it wrote
                self._snapshots.barrier()
            except RuntimeError as exc:  # a rank lost at the very end: its copies stay for a restart
                log.warning("rank %d: the snapshots stay in %s (%s)", self.slot, self._snapshots.files.root,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                return
            self._snapshots.files.remove(self._kept_slots())

    # ----- state --------------------------------------------------------------------------

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

    def _take_buffers(self, state: dict[str, Any], joining: bool) -> None:
        """A DDP model's buffers after a transfer: a survivor at the step the group goes on
        from keeps its own (as at that step's end); rank 0 otherwise (a replacement, or a
        step ahead) takes rank 0's of that step's end, which the survivors received in the
        broken step's forward (DDP broadcasts rank 0's buffers at each forward: the other
        ranks' are overwritten by them before use)."""
        assert self._model is not None
        if not joining and self.step == state["step"]:
            self._step_start.put_back(self._model)
        elif dist.get_rank() == 0:
            received = state.get("received_buffers")
            if received is not None:
                load_buffers(self._model, received)
            elif any(True for _ in self._model.buffers()):
                log.warning("rank %d: rank 0's buffers (BatchNorm's running statistics) were lost with it before the "
                            "broken step's forward: they go on from the sending rank's", self.slot)

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

    def _absorbed(self, plan: keys.Plan) -> list[keys.Plan]:
        """The plans before ``plan`` whose groups completed no step (each a lost rank this
        recovery recovers from too), oldest first: back to the last group that did."""
        assert self._store is not None
        found = []
        for generation in range(plan.generation - 1, 0, -1):
            if self._store.check([keys.recovered_key(generation)]):
                break
            older = keys.read_plan(self._store, generation)
            if older is None:  # drawn by another node supervisor, not published yet: none of ours
                continue
            if older.gave_up:
                break
            found.append(older)
        return found[::-1]

    def _recovery_event(self, lost: keys.Plan, plan: keys.Plan, pending: dict[str, Any]) -> RecoveryEvent:
        """The record of ``lost``'s loss, recovered by ``plan``'s group: its times from its own detection."""
        formed, transferred = plan.detected_at + pending["group_s"], plan.detected_at + pending["transfer_s"]
        return RecoveryEvent(generation=lost.generation, rank=lost.lost, host=lost.host, cause=lost.cause,
                             replaced=lost.replaced, world_size=lost.world_size, step=self.step - 1,
                             detected_at=lost.detected_at, group_s=round(formed - lost.detected_at, 4),
                             transfer_s=round(transferred - lost.detected_at, 4),
                             recover_s=round(time.time() - lost.detected_at, 4), repeated_samples=self._repeated,
                             replacement=lost.replacement, recovered_in=plan.generation, restart=self._restarts,
                             **_rollback_fields(pending["rollback"]))

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


def _snapshot_every(given: int | None, env: Mapping[str, str], slot: int) -> int:
    raw = given if given is not None else env.get(SNAPSHOT_EVERY_VAR, DEFAULT_SNAPSHOT_EVERY)
    try:
        every = int(raw)
    except (TypeError, ValueError):
        every = 0
    if every < 1:
        where = "snapshot_every" if given is not None else SNAPSHOT_EVERY_VAR
        raise RefusedOnRank(f"{where} must be a whole number of steps, at least 1, not {raw!r}", slot)
    return every


def memory_refusal(reports: Sequence[Mapping[str, Any]], held: Mapping[str, int], buddies: Buddies,
                   root: Path) -> str | None:
    """Why the snapshots of the ranks would not fit in their nodes' memory (one line), or
    None. ``reports``: each rank's host and the bytes free there; ``held``: what each host's
    memory would hold at its most (``layout.node_bytes``)."""
    for host in dict.fromkeys(report["host"] for report in reports):
        wanted = held[host]
        free = min(report["free"] for report in reports if report["host"] == host)
        if wanted > free:
            copies = "its ranks' shards" if buddies.replicas == 1 else "its ranks' shards and the copies they hold"
            return (f"the snapshots of the ranks on {host} need about {wanted / 2**30:.2f} GiB of node-local memory "
                    f"({KEPT_STEPS} steps of {copies} and the one being written, and each rank's host buffers) and "
                    f"{free / 2**30:.2f} GiB is free under {root.parent}: give each rank more memory (fewer ranks "
                    f"per node, more nodes), or drop --recover")
    return None


#: What a tensor's data takes beyond its bytes in a serialized snapshot (``torch.save``
#: aligns each record; about half the alignment on average), and what each parameter's
#: Adam state adds before the first step made it (two moments' records and key paths, and
#: the step count). Fitted on torch 2.13: the estimate is within 1% of the snapshot
#: serialized after the step (tests/test_sharded_recovery.py compares them).
ALIGN_BYTES = 16
ADAM_ENTRY_BYTES = 770


def snapshot_bytes(state: Any) -> int:
    """What a snapshot of ``state`` will hold, serialized: everything but the tensors'
    data serialized as it will be (each tensor emptied), plus the data's bytes, with the
    optimizer's state estimated as Adam's (two moments as large as the parameters, a step
    count) where no step has made it yet."""
    objects = state.get("objects", {})
    local, paths = localized(state)
    hollow = state_to_tensor({**_emptied(local), "dtensors": paths}).numel()
    total = hollow + state_bytes(state) + ALIGN_BYTES * tensor_count(state)
    optimizer = objects.get("optimizer")
    if optimizer is not None and not optimizer.get("state"):
        params = sum(len(group.get("params", ())) for group in optimizer.get("param_groups", ()))
        total += 2 * state_bytes(objects.get("model", {})) + params * ADAM_ENTRY_BYTES
    return total


def _emptied(tree: Any) -> Any:
    """``tree`` with each tensor replaced by an empty one of its dtype."""
    if isinstance(tree, torch.Tensor):
        return torch.empty(0, dtype=tree.dtype)
    if isinstance(tree, Mapping):
        return {k: _emptied(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_emptied(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_emptied(v) for v in tree)
    return tree


def tensor_count(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, Mapping):
        return sum(tensor_count(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_count(v) for v in tree)
    return 0


def _from_buddies(rollback: Rollback | None) -> tuple[int, ...]:
    return tuple(slot for slot, source in sorted(rollback.sources.items()) if source != slot) if rollback else ()


def _rollback_fields(rollback: Rollback | None) -> dict[str, Any]:
    if rollback is None:
        return {}
    return {"snapshot_step": rollback.step, "redone_steps": rollback.redone, "from_buddies": _from_buddies(rollback)}


def spare_places(env: Mapping[str, str], slot: int) -> dict[str, str]:
    """``RANK`` and ``LOCAL_RANK`` of a warm spare that takes ``slot``: it started with its
    node's first rank's (``env``), so the node's slots start at ``RANK - LOCAL_RANK``."""
    first_here = int(env.get("RANK", "0")) - int(env.get("LOCAL_RANK", "0"))
    return {"RANK": str(slot), "LOCAL_RANK": str(slot - first_here)}


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


def abort_refusal(backend: str, env: Mapping[str, str]) -> str | None:
    """Why this rank cannot leave a broken ``backend`` group by aborting it (one line), or
    None (and None for a backend that is not aborted)."""
    if backend not in ABORTED_BACKENDS:
        return None
    if not hasattr(dist.ProcessGroup, "abort"):
        return (f"in-job recovery over {backend} aborts a broken group, and this torch ({torch.__version__}) cannot "
                f"(no ProcessGroup.abort; torch 2.9 has it): use a newer torch, or the backend gloo")
    if ABORTED_BACKENDS[backend] == "cuda" and not torch.cuda.is_available():
        return (f"in-job recovery over {backend} needs a CUDA device and this torch ({torch.__version__}) sees none: "
                f"give the backend gloo, or run on the GPU nodes")
    handling = env.get(NCCL_ERROR_HANDLING_VAR, "").strip()
    if handling != "0":
        said = f"{NCCL_ERROR_HANDLING_VAR}={handling}" if handling else f"{NCCL_ERROR_HANDLING_VAR} unset (torch's 3)"
        return (f"{said} lets NCCL's watchdog end this rank when a peer is lost: under --recover the launch sets it "
                f"to 0; leave it so")
    return None


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


def abort_group(group: dist.ProcessGroup, slot: int) -> None:
    """Abort ``group``'s communicators (the heartbeat's thread may call it while the
    training thread waits on the group): its kernels end and its collectives fail."""
    try:
        group.abort()
    except RuntimeError as exc:  # already destroyed: nothing of it is left to end
        log.warning("rank %d: aborting the broken group: %s", slot, str(exc).splitlines()[0] if str(exc) else exc)


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

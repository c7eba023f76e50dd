"""The training state: what a checkpoint holds, built up front, saved and restored.

Everything a resumed run needs is an object here, and one ``Checkpointer`` (the same
public part a loop of one's own uses) saves and restores them all: model, optimizer, LR
schedule, grad scaler, EMA, the data order (``ResumableSampler``: its place in the epoch
is the checkpoint's ``progress``), the metrics history, the config, and the state of the
callbacks that keep some (tracking, early stopping). A checkpoint written by another
world size (or per-rank batch) continues with the rest of its epoch dealt out over this
one and the learning rate rescaled (``engine/reshard.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset

from ddp_hpc.config import Config
from ddp_hpc.config import checkpoint_format as checkpoint_format_name
from ddp_hpc.startup.distributed import DistContext
from ddp_hpc.engine.checkpoint import files as ckpt
from ddp_hpc.engine.checkpoint.background_writer import CheckpointWriteError, WriteRecord
from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
from ddp_hpc.engine.checkpoint.formats import CheckpointFormat, ShardedFormat, make_format
from ddp_hpc.engine.recovery import InJobRecovery
from ddp_hpc.engine.reshard import Resharding, Sharding, lr_factor, plan_resharding, rescale_lr, steps_left
from ddp_hpc.engine.rng import seed_everything
from ddp_hpc.errors import UserError
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.training.checkpoint_upgrade import upgrade_presplit
from ddp_hpc.training.data import LoaderPlan
from ddp_hpc.training.job import Job
from ddp_hpc.training.optim import build_optimizer, build_scheduler, scaled_lr
from ddp_hpc.training.precision import Precision
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.strategy import (full_tensor, is_sharded, load_optimizer_state, model_state,
                                       optimizer_state, wrap_model)

#: The lines users read in job logs keep the source name they always had.
log = logging.getLogger("ddp_hpc.training.trainer")


@dataclass(frozen=True)
class Progress:
    """Where training stands; a checkpoint stores it and resume starts from it."""

    epoch: int = 0          # the epoch in progress, or the next to start
    batches_done: int = 0   # micro-batches of ``epoch`` already trained (at a step boundary)
    global_step: int = 0    # optimizer steps taken in all
    epoch_offset: int = 0   # positions of the epoch's order trained at another world size (see reshard.py)


@dataclass(frozen=True)
class Kept:
    """Plain data a checkpoint keeps under its own name: ``save()`` gives it, ``load(value)`` takes it back."""

    save: Callable[[], Any]
    load: Callable[[Any], None]

    def state_dict(self) -> Any:
        return self.save()

    def load_state_dict(self, value: Any) -> None:
        self.load(value)


@dataclass
class Gathered:
    """A sharded (FSDP2) model's or optimizer's whole state for the single-file format:
    gathered to rank 0 by collectives every rank joins (``consolidate_state_dict``, as
    ZeRO's optimizer, which the ``Checkpointer`` calls on every rank before saving)."""

    gather: Callable[[], Any]
    load: Callable[[Any], None]
    gathered: Any = None

    def consolidate_state_dict(self, to: int = 0) -> None:
        self.gathered = self.gather()

    def state_dict(self) -> Any:
        return self.gathered

    def load_state_dict(self, value: Any) -> None:
        self.load(value)


def parameter_checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return float(sum(full_tensor(p.detach()).double().sum().item() for p in model.parameters()))


def _ignore(value: Any) -> None:
    """The config in a checkpoint is a record (checked against the job on resume), not restored."""


class TrainingState:
    """The objects a run trains and checkpoints, built (and restored, when resuming) at once.

    ``checkpoint_format``: how checkpoints are laid out (one file by default, written in
    the background with ``checkpoint.async``). ``kept``: more objects with
    ``state_dict``/``load_state_dict`` that checkpoints hold under their keys.
    ``on_written``: rank 0 hears of each checkpoint once its file is complete;
    ``on_saving``: every rank, before each save begins. ``recovery``: the group is kept by
    in-job recovery, which wraps the model in DDP for each group (``ddp_model`` is the bare
    model until then; an FSDP2 model is sharded here, once); a replacement (``recovery.joining``) takes every object's state from
    the survivors, so it neither checks the initial weights with them nor reads a checkpoint.
    """

    def __init__(self, job: Job, config: Config, ctx: DistContext, run: RunFolder, train_set: Dataset,
                 precision: Precision, *, checkpoint_format: CheckpointFormat | None = None,
                 kept: Mapping[str, Any] | None = None,
                 on_written: Callable[[WriteRecord], None] | None = None,
                 on_saving: Callable[[], None] | None = None,
                 recovery: InJobRecovery | None = None) -> None:
        self.config, self.ctx, self.run = config, ctx, run
        joining = recovery is not None and recovery.joining
        training = config.training
        format_name = checkpoint_format_name(config, run.checkpoints)
        if config.checkpoint.format is None and format_name != checkpoint_format_name(config, None) \
                and ctx.is_rank_zero:
            log.info("checkpoint.format unset: the run folder holds %s checkpoints only, so this run reads and "
                     "writes that format", format_name)
        if checkpoint_format is None and format_name == "dcp" and training.zero_optimizer:
            raise UserError("checkpoint.format dcp cannot save training.zero_optimizer's state: use "
                            "checkpoint.format=file")
        self.model = self._build_model(job, check=not joining)
        # Under in-job recovery DDP wraps the model for each group; FSDP2 shards it in place once
        # (a recovery points the shards at each new group).
        sharded_here = recovery is None or training.strategy == "fsdp2"
        self.ddp_model = wrap_model(self.model, config, ctx) if sharded_here else self.model
        self.lr = scaled_lr(training, ctx.world_size)
        self.optimizer = build_optimizer(self.model.parameters(), training, self.lr,
                                         shard_state=training.zero_optimizer and ctx.group_initialized)
        self.scaler = precision.scaler()
        self.ema = (AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(training.ema_decay), use_buffers=True)
                    if training.ema_decay else None)
        self.sampler = ResumableSampler(train_set, ctx.world_size, ctx.rank, shuffle=config.data.shuffle,
                                        seed=training.seed, batch_size=training.batch_size,
                                        drop_last_batch=config.data.drop_last)
        #: One row per finished epoch (what ``metrics.jsonl`` holds).
        self.history: list[dict[str, Any]] = []

        file_format = checkpoint_format or make_format(format_name, background=config.checkpoint.async_write)
        plan = LoaderPlan(self.sampler.num_samples, training.batch_size, config.data.drop_last)
        self.steps_per_epoch = math.ceil(plan.batches / training.grad_accum_steps)
        #: Steps the LR schedule spans (known for a resume on another world size only once
        #: its checkpoint is read: the schedule asks for it when it is used).
        self.total_steps = self._total_steps(len(train_set), None)
        sched = training.scheduler
        self.scheduler = build_scheduler(self.optimizer, sched,
                                         (lambda: self.total_steps) if sched.interval == "step" else training.epochs)

        sharded_file = is_sharded(self.model) and not isinstance(file_format, ShardedFormat)
        objects: dict[str, Any] = {
            # A sharded model in one file: its whole state, gathered (a plain model: itself).
            "model": Gathered(lambda: model_state(self.model), self._load_whole_model) if sharded_file else self.model,
            "optimizer": (Gathered(lambda: optimizer_state(self.model, self.optimizer, ctx),
                                   lambda value: load_optimizer_state(self.model, self.optimizer, value))
                          if sharded_file else self.optimizer),
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "ema": self.ema,
            "sampler": self.sampler,
            "history": Kept(lambda: list(self.history), self._load_history),
            "config": Kept(config.to_dict, _ignore),
            **(kept or {}),
        }
        #: Saves at the cadence ``checkpoint.every_n_steps`` / ``every_n_epochs`` (the loop
        #: calls it as a loop of one's own does) and restores.
        self.checkpointer = Checkpointer(run.path, objects, every_n_steps=config.checkpoint.every_n_steps or 0,
                                         every_n_epochs=config.checkpoint.every_n_epochs or 0,
                                         keep_last=config.checkpoint.keep_last, format=file_format, group=ctx,
                                         on_written=on_written, on_saving=on_saving)
        #: Set when the checkpoint resumed from was written by another world size or batch.
        self.resharding: Resharding | None = None
        #: The checkpoint this run resumed from (None: a fresh start).
        self.resumed_from = None if joining else self._restore(len(train_set))

    # ----- building -------------------------------------------------------------------

    def _build_model(self, job: Job, check: bool = True) -> nn.Module:
        seed_everything(self.config.training.seed)  # the same initial weights on every rank
        model = job.build_model().to(self.ctx.device.torch_device)
        if not check:
            return model
        # Gathered to rank 0 only: each gather costs two collectives' latency, growing with the
        # ranks. (Each rank's host and PID reach rank 0 with the run record's facts.)
        checksums = self.ctx.gather_object(parameter_checksum(model)) or []
        if len(set(checksums)) > 1:
            log.warning("build_model gave different weights on different ranks (checksums %s); "
                        "DDP copies rank 0's", checksums)
        return model

    def _total_steps(self, dataset_len: int, change: Resharding | None) -> int:
        training = self.config.training
        total = self.steps_per_epoch * training.epochs
        if change:  # the schedule ends with the training at the new effective batch
            rest = math.ceil((dataset_len - change.position) / self.ctx.world_size)
            total = (change.global_step + steps_left(rest, change.new, self.config.data.drop_last)
                     + self.steps_per_epoch * (training.epochs - change.epoch - 1))
        return min(total, training.max_steps) if training.max_steps else total

    def _load_whole_model(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = ckpt.adapt_state_dict(state, self.model, "checkpoint")
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))

    def _load_history(self, rows: list[dict[str, Any]]) -> None:
        self.history[:] = rows

    # ----- restoring ------------------------------------------------------------------

    def _restore(self, dataset_len: int) -> Path | None:
        training, resume = self.config.training, self.config.checkpoint.resume
        path = None
        if resume != "never":
            path = self.checkpointer.restore(None if resume == "auto" else resume, accept=self._same_job,
                                             upgrade=partial(upgrade_presplit, dataset_len=dataset_len),
                                             quiet=True)
        if path is None:
            seed_everything(training.seed + self.ctx.rank)  # dropout, augmentation: per rank
            return None
        state = self.checkpointer.resumed.state
        if self.ema is not None and state.get("ema") is None:
            self.ema.module.load_state_dict(self.model.state_dict())  # EMA turned on at this resume
        self.resharding = plan_resharding(state["progress"], Sharding.of_checkpoint(state),
                                          Sharding(self.ctx.world_size, training.batch_size, training.grad_accum_steps))
        if self.resharding:
            self.total_steps = self._total_steps(dataset_len, self.resharding)
            self._reshard(path, self.resharding)
        elif self.ctx.is_rank_zero:
            progress = self.progress
            log.info("resuming from %s: epoch %d, batch %d, step %d", path, progress.epoch + 1,
                     progress.batches_done, progress.global_step)
        return path

    def _same_job(self, path: Path, state: Mapping[str, Any]) -> None:
        ckpt.check_same_job((path, dict(state)), self.config.job.name)

    def _reshard(self, path: Path, change: Resharding) -> None:
        """Continue a checkpoint of another world size (or per-rank batch): the rest of the
        epoch dealt out over this one, the learning rate rescaled under ``lr_scaling: linear``."""
        training = self.config.training
        self.sampler.resume_at(change.position)
        # The saved RNG streams belong to the old ranks: new ones, per rank and step.
        seed_everything(training.seed + self.ctx.rank + 1_000_003 * change.global_step)
        factor = lr_factor(change, training.lr_scaling)
        rescale_lr(self.optimizer, self.scheduler, factor)
        if self.ctx.is_rank_zero:
            log.warning("resuming from %s, written by %d ranks, on %d: effective batch %d -> %d (%d x %d x %d); "
                        "%s; epoch %d continues after %d of its samples, the other %d dealt out over %d ranks; "
                        "step %d", path, change.old.world_size, change.new.world_size, change.old.effective_batch_size,
                        change.new.effective_batch_size, change.new.batch_size, change.new.world_size,
                        change.new.grad_accum_steps,
                        f"learning rate x {factor:.4g} (lr_scaling: linear)" if factor != 1.0
                        else f"learning rate kept (lr_scaling: {training.lr_scaling})",
                        change.epoch + 1, change.position, len(self.sampler.dataset) - change.position,
                        change.new.world_size, change.global_step)

    # ----- where training stands, and saving it ----------------------------------------

    @property
    def progress(self) -> Progress:
        return Progress(self.sampler.epoch, self.sampler.batches_done, self.checkpointer.step,
                        self.sampler.epoch_offset)

    def epoch_done(self) -> None:
        """The epoch's last step is done: what follows (validation, its checkpoint) belongs
        to the start of the next."""
        self.sampler.set_epoch(self.sampler.epoch + 1)

    def prestage(self) -> None:
        """``checkpoint.async``: host memory for the largest parts of a checkpoint, allocated
        in the background (once the optimizer has state)."""
        self.checkpointer.prestage(("model", "optimizer", "ema"))

    @contextmanager
    def writes(self, on_progress: Callable[[str], None]) -> Iterator[None]:
        """With ``checkpoint.async``: ``fit`` returns (or raises) only once the last write is
        done; a write still in flight is watched (``on_progress``) like a synchronous one."""
        try:
            yield
        except BaseException:
            on_progress("checkpoint")
            try:
                self.checkpointer.wait(together=False)
            except CheckpointWriteError as exc:  # the error already raised matters more
                log.error("%s", exc)
            raise
        on_progress("checkpoint")
        self.checkpointer.wait(together=False)

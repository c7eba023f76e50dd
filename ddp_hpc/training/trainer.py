"""The Trainer: a user's ``Job`` trained on every rank, built from the engine's public parts.

Built up front, here and nowhere else: the state (``state.py``: what a checkpoint holds, on
a ``Checkpointer`` that owns the checkpoint cadence, with the data order a
``ResumableSampler``), the stop every rank agrees on (a ``StopAgreement``, whose deadline
policy is the engine's), the callbacks (``callbacks.py``, assembled by ``build_callbacks``),
through which the periodic services (``services/``: tracking, early stopping, the background
prestage, the weights check) and the user's own hooks run, and the loop (``loop.py``), each
handed what it uses; the hooks receive the Trainer as a ``TrainerView``, so none of these
imports this module. ``fit`` trains inside the engine's ``watchdog`` (``distributed.watchdog_s``).

Under ``ddp-hpc launch --recover`` the group is kept by the engine's ``InJobRecovery``
(the same part a loop of one's own uses): the loop is the function it runs, with the
Checkpointer (whose objects are everything a checkpoint holds) and the StopAgreement handed
to it, so a lost rank is replaced from the survivors' memory and the failed step redone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_hpc.config import Config
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.startup.distributed import DistContext
from ddp_hpc.engine.checkpoint.background_writer import WriteRecord
from ddp_hpc.engine.checkpoint.formats import CheckpointFormat
from ddp_hpc.engine.liveness import Straggler
from ddp_hpc.engine.recovery import InJobRecovery
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.engine.stop_agreement import StopAgreement
from ddp_hpc.engine.watchdog import watchdog
from ddp_hpc.errors import UserError
from ddp_hpc.summary import RunStatus, RunSummary
from ddp_hpc.tracking import Tracking
from ddp_hpc.training.callbacks import Callback, CallbackList
from ddp_hpc.training.job import Datasets, Job
from ddp_hpc.training.loop import TrainingLoop
from ddp_hpc.training.matmul import apply_matmul_precision, log_tensor_core_hint
from ddp_hpc.training.metrics import MetricSums
from ddp_hpc.training.precision import resolve_precision
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.services.early_stopping import EarlyStopping
from ddp_hpc.training.services.prestage import Prestage
from ddp_hpc.training.services.tracking import TrackingService
from ddp_hpc.training.services.weights_check import WeightsCheckCallback
from ddp_hpc.training.state import Progress, TrainingState, parameter_checksum
from ddp_hpc.training.strategy import recovery_refusal, state_bytes, wrap_ddp_for_recovery

log = logging.getLogger(__name__)

__all__ = ["Trainer", "Progress", "parameter_checksum", "build_callbacks"]


def build_callbacks(config: Config, ctx: DistContext, run: RunFolder, early_stopping: EarlyStopping,
                    callbacks: Sequence[Callback], *, epoch_sums: Callable[[], MetricSums]) -> CallbackList:
    """Every callback of a run, in the order their hooks run: the services the config
    turns on, early stopping, the caller's ``callbacks``, the weights check, tracking last
    (``epoch_sums``: the loop's running sums, which it tracks)."""
    services: list[Callback] = [Prestage()] if config.checkpoint.async_write else []
    checks = ([WeightsCheckCallback(config.distributed.weights_check_every)]
              if config.distributed.weights_check_every else [])
    tracking = TrackingService(Tracking(config, ctx, run), epoch_sums)
    return CallbackList([*services, early_stopping, *callbacks, *checks, tracking])


class Trainer:
    """Builds the datasets, the training state (restored from the newest checkpoint when
    resuming), the stop agreement and the loop at construction; ``fit`` trains.
    ``checkpoint_format``: how checkpoints are laid out (default: one file, rank 0 writes
    it). ``deadline``: the job's end (seconds since the epoch; ``train()`` reads it from the
    environment), which the stop agreement stops ahead of unless
    ``checkpoint.deadline_margin_s`` is null; ``clock`` tells the time for it."""

    def __init__(self, job: Job, config: Config, ctx: DistContext, run: RunFolder,
                 callbacks: Sequence[Callback] = (), *, checkpoint_format: CheckpointFormat | None = None,
                 deadline: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self._created = time.perf_counter()
        self.job, self.config, self.ctx, self.run = job, config, ctx, run
        self.training = config.training
        self.precision = resolve_precision(config.training.precision, ctx.device.device_type)
        #: In-job recovery keeps the group (``ddp-hpc launch --recover``); None otherwise.
        self.recovery = ctx.keeper if isinstance(ctx.keeper, InJobRecovery) else None
        refusal = recovery_refusal(config) if self.recovery is not None else None
        if refusal:  # train() refused it before the group started; a Trainer built directly is checked here
            raise ConfigError(refusal)
        self._setup_runtime()
        self.datasets = job.build_datasets()
        self._check_datasets(self.datasets)
        self.early_stopping = EarlyStopping(config.validation.early_stopping)
        self.callbacks = build_callbacks(config, ctx, run, self.early_stopping, callbacks,
                                         epoch_sums=lambda: self.loop.epoch_sums)
        self.state = TrainingState(job, config, ctx, run, self.datasets.train, self.precision,
                                   checkpoint_format=checkpoint_format, kept=self.callbacks.stateful(),
                                   on_written=self._checkpoint_written, on_saving=self._saving,
                                   recovery=self.recovery)
        margin = config.checkpoint.deadline_margin_s
        #: The stop every rank agrees on: a signal handler calls ``request_stop``; rank 0
        #: requests it ahead of ``deadline``.
        self.stop = StopAgreement(self.state.checkpointer,
                                  check_every_n_steps=config.checkpoint.preemption_check_every_n_steps,
                                  deadline=deadline if margin is not None else None,
                                  margin_s=margin if margin is not None else "auto", group=ctx, clock=clock)
        self.loop = TrainingLoop(job, config, ctx, self.precision, self.state, self.datasets,
                                 callbacks=self.callbacks, stop=self.stop, run=run, recovery=self.recovery,
                                 view=self)
        #: Rank 0: the stragglers the watchdog's heartbeat named, by rank (kept in the run record).
        self.stragglers: dict[int, Straggler] = {}

    # ----- set-up -----------------------------------------------------------------------

    def _setup_runtime(self) -> None:
        if self.training.threads_per_rank:
            torch.set_num_threads(self.training.threads_per_rank)
        apply_matmul_precision(self.training.matmul_precision)
        if self.training.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

    def _check_datasets(self, datasets: Datasets) -> None:
        size = len(datasets.train)
        if size < self.ctx.world_size:
            raise UserError(f"world size {self.ctx.world_size} is larger than the training set "
                            f"({size} samples): use fewer ranks")
        per_rank = math.ceil(size / self.ctx.world_size)
        if self.config.data.drop_last and per_rank < self.training.batch_size:
            raise UserError(f"training.batch_size {self.training.batch_size} exceeds each rank's "
                            f"{per_rank} training samples with data.drop_last: no batch would run")

    # ----- what callbacks read ----------------------------------------------------------

    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def joining(self) -> bool:
        """This process replaces a lost rank: its state comes from the survivors once
        training starts (nothing it holds before that counts)."""
        return self.recovery is not None and self.recovery.joining

    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def ddp_model(self) -> nn.Module:
        return self.state.ddp_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def scheduler(self) -> Any:
        return self.state.scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self.state.scaler

    @property
    def ema(self) -> nn.Module | None:
        return self.state.ema

    @property
    def sampler(self) -> ResumableSampler:
        return self.state.sampler

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.state.history

    @property
    def steps_per_epoch(self) -> int:
        return self.state.steps_per_epoch

    @property
    def loader(self) -> DataLoader:
        return self.loop.loader

    @property
    def pin_memory(self) -> bool:
        return self.loop.pin_memory

    @property
    def effective_batch_size(self) -> int:
        return self.training.batch_size * self.ctx.world_size * self.training.grad_accum_steps

    def request_stop(self) -> None:
        """Checkpoint and stop at the next agreed step (from a signal handler: just a flag)."""
        self.stop.request()

    def evaluate(self, dataset) -> tuple[dict[str, float], int]:
        """Metrics over ``dataset``, each sample counted exactly once across ranks."""
        return self.loop.evaluate(dataset)

    # ----- the run ----------------------------------------------------------------------

    def fit(self) -> RunSummary:
        if self.ctx.is_rank_zero:
            self.run.create(self.config.to_dict())
        self._log_start()
        self.callbacks.on_fit_start(self)
        self.stop.start()
        with self._watching(), self.callbacks.running(self), self.state.writes(self.loop.beat):
            status = self._train()
            if status == "preempted":
                self.ctx.barrier()  # no rank exits (REQUEUE) before rank 0's checkpoint is on disk
                if self.ctx.is_rank_zero:
                    log.warning("stopped %s at epoch %d, step %d: checkpoint saved; rerun or requeue the job "
                                "to resume", self.stop.reason, self.progress.epoch + 1, self.progress.global_step)
                self.callbacks.on_stopped(self)  # rank 0's stop marker for a batch script: StopAgreement's
                return self._summary(RunStatus.PREEMPTED, None, write=False)
            test_metrics = self.loop.test()
        summary = self._summary(RunStatus(status), test_metrics)
        self.callbacks.on_fit_end(self, summary)
        return summary

    def _train(self) -> str:
        """The loop; under in-job recovery, the function ``InJobRecovery.run`` calls (again
        after each recovery, with the state as the survivors held it after the last step
        every rank completed)."""
        recovery = self.recovery
        if recovery is None:
            return self.loop.run()
        sharded = self.config.training.strategy == "fsdp2"  # sharded in place: its own wrapper on each group
        return recovery.run(self._train_from_here, model=self.model, optimizer=self.optimizer, sampler=self.sampler,
                            checkpointer=self.state.checkpointer, stop=self.stop,
                            wrap=None if sharded else lambda model: wrap_ddp_for_recovery(model, self.config, self.ctx))

    def _train_from_here(self, wrapped: nn.Module) -> str:
        if torch.distributed.get_world_size() != self.ctx.world_size:  # train() refuses --shrink first
            raise UserError(f"the Trainer does not yet go on with fewer ranks ({self.ctx.world_size} -> "
                            f"{torch.distributed.get_world_size()}): launch with --recover without --shrink")
        self.state.ddp_model = wrapped
        self.state.optimizer.zero_grad(set_to_none=True)  # what the failed step accumulated
        try:
            return self.loop.run()
        except BaseException:
            # InJobRecovery frees the wrapper (it holds the broken group) before leaving it.
            self.state.ddp_model = self.model
            raise

    @contextmanager
    def _watching(self) -> Iterator[None]:
        """``distributed.watchdog_s``: the engine's watchdog around training, watched from
        the first step on (set-up, datasets and resume, may take long legitimately); its
        heartbeat uses the group's rendezvous store, or under in-job recovery is the
        recovery's own (in the launch's store: one heartbeat thread per rank)."""
        limit_s = self.config.distributed.watchdog_s
        if not limit_s:
            yield
            return
        ctx = self.ctx
        # Under in-job recovery the watchdog reports through the recovery's heartbeat, the one
        # the launch's hang detector (--hang-timeout) reads.
        store = ((ctx.env.master_addr, ctx.env.master_port)
                 if ctx.group_initialized and ctx.world_size > 1 and self.recovery is None else None)
        with watchdog(limit_s, heartbeat_store=store, on_straggler=self._straggler if ctx.is_rank_zero else None,
                      limit_name="distributed.watchdog_s",
                      heartbeat=self.recovery.heartbeat if self.recovery is not None else None) as self.loop.watchdog:
            try:
                yield
            finally:
                self.loop.watchdog = None

    def _straggler(self, straggler: Straggler) -> None:
        """Rank 0's heartbeat thread: keep what it found in the run record."""
        self.stragglers[straggler.rank] = straggler
        self.run.write_stragglers([asdict(found) for found in self.stragglers.values()])

    def _saving(self) -> None:
        self.loop.beat("checkpoint")

    def _checkpoint_written(self, record: WriteRecord) -> None:
        self.callbacks.on_checkpoint_saved(self, record.path)

    def _log_start(self) -> None:
        if not self.ctx.is_rank_zero:
            return
        training = self.training
        log.info("job %s: %d train samples, world size %d, %s on %s, precision %s",
                 self.config.job.name, len(self.datasets.train), self.ctx.world_size, self.ctx.device.backend,
                 self.ctx.device.torch_device, self.precision.name)
        log_tensor_core_hint(self.ctx.torch_device, lower_precision_compute=self.precision.dtype is not None
                             or self.config.fsdp.mixed_precision != "none")
        log.info("batch %d per rank x %d ranks x %d accumulation = effective batch %d; lr %.3g%s; "
                 "%d steps per epoch", training.batch_size, self.ctx.world_size,
                 training.grad_accum_steps, self.effective_batch_size, self.state.lr,
                 " (scaled linearly)" if training.lr_scaling == "linear" else "", self.steps_per_epoch)
        log.info("run folder: %s", self.run.path)

    def _summary(self, status: RunStatus, test: dict[str, float] | None, write: bool = True) -> RunSummary:
        progress = self.progress
        gathered = self.ctx.all_gather_object((progress.epoch, parameter_checksum(self.model),
                                               state_bytes(self.model, self.optimizer)))
        rates = [row["samples_per_s"] for row in self.history if row.get("samples_per_s")]
        summary = RunSummary(
            status=status,
            run_dir=str(self.run.path),
            job=self.config.job.name,
            epochs_completed=progress.epoch,
            global_step=progress.global_step,
            world_size=self.ctx.world_size,
            backend=self.ctx.device.backend,
            device=str(self.ctx.device.torch_device),
            effective_batch_size=self.effective_batch_size,
            samples_per_s=round(sum(rates) / len(rates), 2) if rates else None,
            wall_time_s=round(time.perf_counter() - self._created, 3),
            final=self.history[-1] if self.history else {},
            best=self.early_stopping.best(),
            test=test,
            epochs_run_per_rank=[epoch for epoch, _, _ in gathered],
            parameter_checksums_per_rank=[checksum for _, checksum, _ in gathered],
            state_bytes_per_rank=[size for _, _, size in gathered],
        )
        if self.ctx.is_rank_zero and write:
            self.run.write_summary(summary)
        return summary

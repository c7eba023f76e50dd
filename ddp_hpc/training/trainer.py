"""The Trainer: everything around the user's step that distributed training needs."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ddp_hpc.config import Config, checkpoint_format
from ddp_hpc.distributed import DistContext
from ddp_hpc.errors import UserError
from ddp_hpc.summary import RunStatus, RunSummary
from ddp_hpc.tracking import RunShape, Tracking
from ddp_hpc.engine import checkpoint_files as ckpt
from ddp_hpc.engine.background_writer import AsyncCheckpointWriter, CheckpointWriteError
from ddp_hpc.engine.dcp_format import DcpFormat, ShardedState, check_complete, read_blob, SHARED_KEY
from ddp_hpc.training.callbacks import Callback
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.engine.stop_agreement import StopAgreement
from ddp_hpc.training.data import LoaderPlan, eval_loader, shard_padding_mask, train_loader
from ddp_hpc.training.early_stopping import EarlyStoppingState, Verdict, update
from ddp_hpc.training.job import Datasets, Job, StepOutput
from ddp_hpc.engine.liveness import Straggler, watch_progress
from ddp_hpc.training.metrics import MetricSums
from ddp_hpc.training.optim import build_optimizer, build_scheduler, scaled_lr
from ddp_hpc.training.precision import resolve_precision
from ddp_hpc.engine.reshard import Resharding, Sharding, lr_factor, plan_resharding, rescale_lr, steps_left
from ddp_hpc.engine.rng import capture_rng, restore_rng, seed_everything
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.strategy import (full_tensor, load_optimizer_state, model_state, optimizer_state,
                                       state_bytes, wrap_model)
from ddp_hpc.engine.watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where training stands; a checkpoint stores it and resume starts from it."""

    epoch: int = 0          # the epoch in progress, or the next to start
    batches_done: int = 0   # micro-batches of ``epoch`` already trained (at a step boundary)
    global_step: int = 0    # optimizer steps taken in all
    epoch_offset: int = 0   # positions of the epoch's order trained at another world size (see reshard.py)


def parameter_checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return float(sum(full_tensor(p.detach()).double().sum().item() for p in model.parameters()))


class Trainer:
    def __init__(self, job: Job, config: Config, ctx: DistContext, run: RunFolder,
                 callbacks: Sequence[Callback] = ()) -> None:
        self.job, self.config, self.ctx, self.run = job, config, ctx, run
        self.callbacks = list(callbacks)
        self.training = config.training
        self.device = ctx.device.torch_device
        self.precision = resolve_precision(config.training.precision, ctx.device.device_type)
        self.progress = Progress()
        self.early = EarlyStoppingState()
        self.history: list[dict[str, Any]] = []
        #: The stop every rank agrees on (a signal handler calls ``request_stop``; the
        #: deadline is the DeadlineStop callback's, which measures the Trainer's phases).
        self.stop = StopAgreement(check_every_n_steps=config.checkpoint.preemption_check_every_n_steps,
                                  deadline=None, group=ctx)
        self.preempted = False
        self._step_save_pending = False
        self.watchdog: Watchdog | None = None
        #: Rank 0: the stragglers its heartbeat named, by rank (kept in the run record).
        self.stragglers: dict[int, Straggler] = {}
        self.tracking = Tracking(config, ctx, run)
        #: Seconds rank 0's latest checkpoint write took (the deadline stop uses it).
        self.last_checkpoint_s = 0.0
        self.resharding: Resharding | None = None
        #: checkpoint.format dcp: every rank writes its part of a checkpoint folder.
        self.sharded = (DcpFormat(background=config.checkpoint.async_write)
                        if checkpoint_format(config) == "dcp" else None)
        #: checkpoint.async with format file: rank 0's background writer (None: synchronous saves).
        self.checkpoint_writer = (AsyncCheckpointWriter() if config.checkpoint.async_write and self.sharded is None
                                  else None)
        if self.sharded is not None and config.training.zero_optimizer:
            raise UserError("checkpoint.format dcp cannot save training.zero_optimizer's state: use "
                            "checkpoint.format=file")
        #: This rank's part of the checkpoint resumed from (its RNG streams).
        self._resumed_rank_part: dict[str, Any] = {}

    # ----- setup ------------------------------------------------------------------------

    @property
    def effective_batch_size(self) -> int:
        return self.training.batch_size * self.ctx.world_size * self.training.grad_accum_steps

    def _setup_runtime(self) -> None:
        if self.training.threads_per_rank:
            torch.set_num_threads(self.training.threads_per_rank)
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

    def _build_model(self) -> nn.Module:
        seed_everything(self.training.seed)  # the same initial weights on every rank
        model = self.job.build_model().to(self.device)
        # Gathered to rank 0 only: each gather costs two collectives' latency, growing with the
        # ranks. (Each rank's host and PID reach rank 0 with the run record's facts.)
        checksums = self.ctx.gather_object(parameter_checksum(model)) or []
        if len(set(checksums)) > 1:
            log.warning("build_model gave different weights on different ranks (checksums %s); "
                        "DDP copies rank 0's", checksums)
        return model

    def _find_resume_state(self) -> tuple[Path, dict[str, Any]] | None:
        resume = self.config.checkpoint.resume
        if resume == "never":
            return None
        if resume == "auto":
            if self.sharded is not None:
                path = self.sharded.newest(self.ctx, self.run.checkpoints)
                if path is not None:
                    return ckpt.check_same_job((path, self._sharded_shared(path)), self.config.job.name)
            found = ckpt.newest_loadable(self.run.checkpoints)
            return ckpt.check_same_job(found, self.config.job.name) if found else None
        path = Path(resume)
        if path.is_dir():
            return ckpt.check_same_job((path, self._sharded_shared(path)), self.config.job.name)
        return ckpt.check_same_job((path, ckpt.load_checkpoint(path)), self.config.job.name)

    @staticmethod
    def _sharded_shared(path: Path) -> dict[str, Any]:
        """A dcp checkpoint's plain data (progress, config, ...): every rank reads it itself."""
        state = read_blob(path, check_complete(path), SHARED_KEY)
        if not isinstance(state, dict) or state.get("format") != ckpt.FORMAT_VERSION:
            raise ckpt.CheckpointError(f"checkpoint {path} is not a ddp_hpc checkpoint (format {ckpt.FORMAT_VERSION})")
        return state

    # ----- the run ----------------------------------------------------------------------

    def _beat(self, phase: str, compute_s: float | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(phase, self.progress.global_step, compute_s)

    def _record_straggler(self, straggler: Straggler) -> None:
        """Rank 0's heartbeat thread: keep what it found in the run record."""
        self.stragglers[straggler.rank] = straggler
        self.run.write_stragglers([asdict(found) for found in self.stragglers.values()])

    def fit(self) -> RunSummary:
        started = time.perf_counter()
        self._setup_runtime()
        datasets = self.job.build_datasets()
        self._check_datasets(datasets)
        resume = self._find_resume_state()
        if resume:
            self.resharding = plan_resharding(resume[1]["progress"], Sharding.of_checkpoint(resume[1]), Sharding(
                self.ctx.world_size, self.training.batch_size, self.training.grad_accum_steps))

        self.model = self._build_model()
        if resume and not resume[0].is_dir():
            self.model.load_state_dict(ckpt.adapt_state_dict(resume[1]["model"], self.model, str(resume[0])))
        self.ddp_model = wrap_model(self.model, self.config, self.ctx)
        self.lr = scaled_lr(self.training, self.ctx.world_size)
        self.optimizer = build_optimizer(self.model.parameters(), self.training, self.lr,
                                         shard_state=self.training.zero_optimizer and self.ctx.group_initialized)
        self.scaler = self.precision.scaler()
        self.ema = (AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(self.training.ema_decay),
                                  use_buffers=True) if self.training.ema_decay else None)

        self.sampler = ResumableSampler(datasets.train, self.ctx.world_size, self.ctx.rank,
                                                   shuffle=self.config.data.shuffle, seed=self.training.seed)
        pin = self.config.data.pin_memory
        self.pin_memory = self.ctx.device.device_type == "cuda" if pin == "auto" else bool(pin)
        self.loader = train_loader(datasets.train, self.sampler, self.training.batch_size, self.config.data,
                                   self.pin_memory)
        self.plan = LoaderPlan(self.sampler.num_samples, self.training.batch_size, self.config.data.drop_last)
        self.steps_per_epoch = math.ceil(self.plan.batches / self.training.grad_accum_steps)
        total_steps = self.steps_per_epoch * self.training.epochs
        if self.resharding:  # the schedule ends with the training at the new effective batch
            rest = math.ceil((len(datasets.train) - self.resharding.position) / self.ctx.world_size)
            total_steps = (self.resharding.global_step + steps_left(rest, self.resharding.new, self.config.data.drop_last)
                           + self.steps_per_epoch * (self.training.epochs - self.resharding.epoch - 1))
        if self.training.max_steps:
            total_steps = min(total_steps, self.training.max_steps)
        sched = self.training.scheduler
        self.scheduler = build_scheduler(self.optimizer, sched,
                                         total_steps if sched.interval == "step" else self.training.epochs)

        if resume:
            if resume[0].is_dir():  # a dcp folder: the modules and optimizer are loaded in place
                self._resumed_rank_part = DcpFormat().load(self.ctx, resume[0], self._sharded_state({}, {})).mine
            else:
                self._resumed_rank_part = self._file_rank_part(*resume)
            self._restore(*resume)
        else:
            seed_everything(self.training.seed + self.ctx.rank)  # dropout, augmentation: per rank
        if self.ctx.is_rank_zero:
            self.run.create(self.config.to_dict())
            for name in ckpt.remove_stale_temporaries(self.run.checkpoints):
                log.info("removed %s, left by a checkpoint write that was interrupted", name)
        self._log_start(datasets)
        self.tracking.start(RunShape(self.ctx.world_size, self.effective_batch_size, self.training.epochs,
                                     self.steps_per_epoch, total_steps), self.progress.global_step,
                            resume[1].get("tracking") if resume else None, self.history)
        for callback in self.callbacks:
            callback.on_fit_start(self)

        # Watched from the first step on: set-up (datasets, resume) may take long legitimately.
        limit = self.config.distributed.watchdog_s
        straggling = self._record_straggler if self.ctx.is_rank_zero else None
        with watch_progress(self.ctx, limit, straggling) as self.watchdog, self._checkpoint_writes():
            status = self._train_epochs(datasets)
            if status == "preempted":
                self.ctx.barrier()  # no rank exits (REQUEUE) before rank 0's checkpoint is on disk
                if self.ctx.is_rank_zero:
                    log.warning("stopped on request at epoch %d, step %d: checkpoint saved; rerun or requeue "
                                "the job to resume", self.progress.epoch + 1, self.progress.global_step)
                self.tracking.finish(completed=False)
                if self.ctx.is_rank_zero:
                    self.run.mark_preempted()
                return self._summary(started, RunStatus.PREEMPTED, None, write=False)
            test_metrics = self._test(datasets)
        summary = self._summary(started, RunStatus(status), test_metrics)
        self.tracking.finish(completed=True)
        for callback in self.callbacks:
            callback.on_fit_end(self, summary)
        return summary

    def _log_start(self, datasets: Datasets) -> None:
        if not self.ctx.is_rank_zero:
            return
        log.info("job %s: %d train samples, world size %d, %s on %s, precision %s",
                 self.config.job.name, len(datasets.train), self.ctx.world_size, self.ctx.device.backend,
                 self.ctx.device.torch_device, self.precision.name)
        log.info("batch %d per rank x %d ranks x %d accumulation = effective batch %d; lr %.3g%s; "
                 "%d steps per epoch", self.training.batch_size, self.ctx.world_size,
                 self.training.grad_accum_steps, self.effective_batch_size, self.lr,
                 " (scaled linearly)" if self.training.lr_scaling == "linear" else "", self.steps_per_epoch)
        log.info("run folder: %s", self.run.path)

    def request_stop(self) -> None:
        """Checkpoint and stop at the next agreed step (from a signal handler: just a flag)."""
        self.stop.request()

    @property
    def stop_requested(self) -> bool:
        return self.stop.requested

    def _agreed_stop(self) -> bool:
        """Whether any rank was asked to stop; all ranks answer at the same steps."""
        return self.stop.agreed(self.progress.global_step)

    def _train_epochs(self, datasets: Datasets) -> str:
        """Train from ``self.progress`` on: "completed", "early_stopped" or "preempted"."""
        while self.progress.epoch < self.training.epochs:
            epoch = self.progress.epoch
            epoch_started = time.perf_counter()
            train_metrics, samples = self._train_one_epoch(epoch)
            if self.progress.batches_done < self.plan.batches:
                # Stopped inside the epoch (preemption, max_steps): save where we are.
                self.save_checkpoint(improved=False)
                return "preempted" if self.preempted else "completed"
            elapsed = time.perf_counter() - epoch_started
            self.progress = Progress(epoch + 1, 0, self.progress.global_step)
            if self.scheduler and self.training.scheduler.interval == "epoch":
                self.scheduler.step()

            row: dict[str, Any] = {"epoch": epoch + 1, "step": self.progress.global_step,
                                   "lr": self.optimizer.param_groups[0]["lr"],
                                   "epoch_time_s": round(elapsed, 4),
                                   "samples_per_s": round(samples / elapsed, 2) if elapsed > 0 else None,
                                   **{f"train_{k}": v for k, v in train_metrics.items()}}
            verdict = Verdict(improved=False, stop=False)
            last_epoch = self.progress.epoch == self.training.epochs or self._reached_max_steps()
            if datasets.val is not None and ((epoch + 1) % self.config.validation.every_n_epochs == 0 or last_epoch):
                val_metrics, _ = self.evaluate(datasets.val)
                row.update({f"val_{k}": v for k, v in val_metrics.items()})
                verdict = self._early_stopping(val_metrics, epoch + 1)
            self.history.append(row)
            self.tracking.on_epoch(row)
            if self.ctx.is_rank_zero:
                self.run.append_metrics(row)
                log.info(self._epoch_line(row))
            every = self.config.checkpoint.every_n_epochs
            if (every and (epoch + 1) % every == 0) or last_epoch or verdict.stop or verdict.improved \
                    or self._step_save_pending or self.preempted:
                self.save_checkpoint(improved=verdict.improved)
            for callback in self.callbacks:
                callback.on_epoch_end(self, row)
            if self.preempted and not last_epoch:
                return "preempted"
            if verdict.stop:
                if self.ctx.is_rank_zero:
                    log.info("early stopping after epoch %d: no improvement of validation %s for %d "
                             "validations (best %.6g at epoch %d)", epoch + 1,
                             self.config.validation.early_stopping.metric, self.early.bad_validations,
                             self.early.best, self.early.best_epoch)
                return "early_stopped"
            if self._reached_max_steps():
                return "completed"
        return "completed"

    def _reached_max_steps(self) -> bool:
        return bool(self.training.max_steps) and self.progress.global_step >= self.training.max_steps

    def _train_one_epoch(self, epoch: int) -> tuple[dict[str, float], int]:
        self.ddp_model.train()
        self.sampler.set_epoch(epoch)
        self.sampler.start_epoch_at(self.progress.epoch_offset)
        self.plan = LoaderPlan(self.sampler.num_samples, self.training.batch_size, self.config.data.drop_last)
        start_batch = self.progress.batches_done
        self.sampler.skip_next(start_batch * self.training.batch_size)
        # Reseeded per epoch so a resumed epoch gives workers the same seeds as the original.
        self.loader.generator.manual_seed(self.training.seed * 1_000_003 + epoch)
        accum, total_batches = self.training.grad_accum_steps, self.plan.batches
        sums = MetricSums(self.device)
        self._step_save_pending = False
        batches = self._progress_bar(self.loader, epoch, start_batch, total_batches)
        batch_index = start_batch
        forward_s = 0.0  # the step's own work, which no collective waits in (the straggler check)
        for batch in batches:
            window_start = (batch_index // accum) * accum
            window = min(accum, total_batches - window_start)
            closes_window = batch_index + 1 == window_start + window
            sync = closes_window or not isinstance(self.ddp_model, DistributedDataParallel)
            batch = self.job.move_batch(batch, self.device, non_blocking=self.pin_memory)
            with nullcontext() if sync else self.ddp_model.no_sync():
                forward_started = time.perf_counter()
                with self.precision.autocast():
                    output = self.job.training_step(self.ddp_model, batch)
                forward_s += time.perf_counter() - forward_started
                self.scaler.scale(output.loss / window).backward()
            sums.add(self._per_sample(output))
            batch_index += 1
            if not closes_window:
                continue
            self._optimizer_step()
            self.progress = replace(self.progress, batches_done=batch_index, global_step=self.progress.global_step + 1)
            if self.checkpoint_writer is not None and not self.checkpoint_writer.staged and self.ctx.is_rank_zero:
                self._prestage_checkpoint()
            self._beat("training", forward_s)
            forward_s = 0.0
            for callback in self.callbacks:
                callback.on_step_end(self)
            self._maybe_log_step(sums)
            self.tracking.on_step(epoch, self.progress.global_step, sums, self.optimizer.param_groups[0]["lr"])
            every = self.config.checkpoint.every_n_steps
            if every and self.progress.global_step % every == 0:
                if batch_index < total_batches:
                    self.save_checkpoint(improved=False)
                else:
                    self._step_save_pending = True  # the epoch-end checkpoint covers it
            if self._agreed_stop():
                self.preempted = True
                break
            if self._reached_max_steps():
                break
        metrics, samples = sums.reduce(self.ctx)
        return metrics, samples

    @staticmethod
    def _per_sample(output: StepOutput) -> dict[str, torch.Tensor]:
        if output.per_sample:
            return output.per_sample
        return {"loss": output.loss.detach().reshape(1)}

    def _optimizer_step(self) -> None:
        if self.training.grad_clip_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.training.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        if self.scheduler and self.training.scheduler.interval == "step":
            self.scheduler.step()

    def _progress_bar(self, loader, epoch: int, start: int, total: int):
        mode = self.config.logging.progress
        show = self.ctx.is_rank_zero and (mode == "always" or (mode == "auto" and sys.stderr.isatty()))
        if not show:
            return loader
        from tqdm import tqdm

        return tqdm(loader, total=total, initial=start, desc=f"epoch {epoch + 1}/{self.training.epochs}",
                    leave=False, dynamic_ncols=True, file=sys.stderr)

    def _maybe_log_step(self, sums: MetricSums) -> None:
        every = self.config.logging.log_every_n_steps
        if every and self.progress.global_step % every == 0 and self.ctx.is_rank_zero:
            loss = sums.sums.get("loss")
            if loss is not None:
                log.info("step %d: train loss (this rank, epoch so far) %.4f", self.progress.global_step,
                         float(loss / sums.count))

    # ----- validation, early stopping, test ------------------------------------------------

    def evaluate(self, dataset) -> tuple[dict[str, float], int]:
        """Metrics over ``dataset``, each sample counted exactly once across ranks."""
        model = self.ema.module if self.ema is not None else self.model
        was_training = model.training
        model.eval()
        batch_size = self.config.validation.batch_size or self.training.batch_size
        loader = eval_loader(dataset, self.ctx.rank, self.ctx.world_size, batch_size, self.config.data,
                             self.pin_memory)
        sums = MetricSums(self.device)
        position = 0
        with torch.no_grad(), self.precision.autocast():
            for batch in loader:
                batch = self.job.move_batch(batch, self.device, non_blocking=self.pin_memory)
                per_sample = self.job.eval_step(model, batch)
                length = next(iter(per_sample.values())).reshape(-1).shape[0]
                mask = shard_padding_mask(position, length, self.ctx.rank, self.ctx.world_size,
                                          len(dataset), self.device)
                sums.add(per_sample, mask)
                position += length
                self._beat("evaluation")
        model.train(was_training)
        metrics, count = sums.reduce(self.ctx)
        if count != len(dataset):
            raise RuntimeError(f"evaluation counted {count} samples of {len(dataset)}")
        return metrics, count

    def _early_stopping(self, val_metrics: dict[str, float], epoch: int) -> Verdict:
        config = self.config.validation.early_stopping
        if config.metric not in val_metrics:
            raise UserError(f"validation.early_stopping.metric {config.metric!r} is not reported by the "
                            f"job (it reports: {', '.join(sorted(val_metrics))})")
        verdict = update(self.early, config, val_metrics[config.metric], epoch) if self.ctx.is_rank_zero else None
        verdict, state = self.ctx.broadcast_object((verdict, self.early))
        self.early = state
        return verdict

    def _test(self, datasets: Datasets) -> dict[str, float] | None:
        if datasets.test is None:
            return None
        metrics, count = self.evaluate(datasets.test)
        self.tracking.on_test(self.progress.global_step, metrics)
        if self.ctx.is_rank_zero:
            log.info("test: %s (%d samples)", "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())), count)
        return metrics

    # ----- checkpoints ----------------------------------------------------------------------

    def _prestage_checkpoint(self) -> None:
        """checkpoint.async: host buffers for the largest parts of a checkpoint, allocated in
        the background once the optimizer has state (after the first step)."""
        parts: dict[str, Any] = {"model": self.model.state_dict()}
        if not hasattr(self.optimizer, "consolidate_state_dict"):  # ZeRO's state needs a collective
            parts["optimizer"] = self.optimizer.state_dict()
        if self.ema is not None:
            parts["ema"] = self.ema.state_dict()
        self.checkpoint_writer.prestage(parts)

    def _sharded_state(self, shared: dict[str, Any], per_rank: dict[str, Any]) -> ShardedState:
        modules: dict[str, nn.Module] = {"model": self.model}
        if self.ema is not None:
            modules["ema"] = self.ema
        return ShardedState(modules, {"optimizer": (self.model, self.optimizer)}, shared, per_rank)

    def _file_rank_part(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a single-file checkpoint: its own small file beside it (or,
        in files written before those existed, the list of every rank's RNG inside it)."""
        if int(state.get("world_size", -1)) != self.ctx.world_size:
            return {}
        if "rng" in state:
            return {"rng": state["rng"][self.ctx.rank]}
        return ckpt.load_rank_part(path.parent, int(state["progress"]["global_step"]), self.ctx.rank)

    def save_checkpoint(self, improved: bool) -> Path | None:
        """Every rank calls this and writes its own RNG streams; rank 0 writes the file
        (``checkpoint.format: dcp``: every rank writes its part of the folder)."""
        self._beat("checkpoint")
        started = time.perf_counter()
        shared = {
            "format": ckpt.FORMAT_VERSION,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict(),
            "progress": asdict(self.progress),
            "world_size": self.ctx.world_size,
            "early_stopping": self.early.to_dict(),
            "history": self.history,
            "config": self.config.to_dict(),
            "tracking": self.tracking.state(self.progress.global_step),
        }
        if self.sharded is not None:
            path = self.sharded.save(self.ctx, self.run.checkpoints, self.progress.global_step,
                                     self._sharded_state(shared, {"rng": capture_rng()}),
                                     keep_last=self.config.checkpoint.keep_last,
                                     best=improved and self.config.checkpoint.save_best)
            self.last_checkpoint_s = time.perf_counter() - started
            self._checkpoints_written(self.sharded.take_finished())
            return path
        model = model_state(self.model)  # with the optimizer's: collectives under ZeRO and fsdp2
        optimizer = optimizer_state(self.model, self.optimizer, self.ctx)
        ckpt.save_rank_part(self.run.checkpoints, self.progress.global_step, self.ctx.rank, {"rng": capture_rng()})
        self.ctx.barrier()  # every rank's part is on disk before the file that makes the checkpoint count
        if not self.ctx.is_rank_zero:
            return None
        state = {
            **shared,
            "model": model,
            "optimizer": optimizer,
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }
        path = ckpt.step_path(self.run.checkpoints, self.progress.global_step)
        write = partial(ckpt.write_checkpoint, path=path, best=improved and self.config.checkpoint.save_best,
                        keep_last=self.config.checkpoint.keep_last)
        if self.checkpoint_writer is not None:
            # Blocks for the previous write and the copy to host memory; callbacks hear of a
            # file once its write is known to be complete.
            self._checkpoints_written(self.checkpoint_writer.submit(state, path, write))
            self.last_checkpoint_s = time.perf_counter() - started  # what training waited for
            return path
        write(state)
        self.last_checkpoint_s = time.perf_counter() - started
        log.debug("checkpoint %s (epoch %d, batch %d, step %d)", path, self.progress.epoch,
                  self.progress.batches_done, self.progress.global_step)
        for callback in self.callbacks:
            callback.on_checkpoint_saved(self, path)
        return path

    @contextmanager
    def _checkpoint_writes(self):
        """With checkpoint.async: ``fit`` returns (or raises) only once the last write is done."""
        try:
            yield
        except BaseException:
            if self.sharded is not None:
                try:
                    self.sharded.wait()
                except CheckpointWriteError as exc:  # the error already raised matters more
                    log.error("%s", exc)
            if self.checkpoint_writer is not None:
                self._beat("checkpoint")
                try:
                    self.checkpoint_writer.wait()
                except CheckpointWriteError as exc:  # the error already raised matters more
                    log.error("%s", exc)
            raise
        if self.checkpoint_writer is not None:
            self._beat("checkpoint")  # a write still in flight is watched like a synchronous one
            self._checkpoints_written(self.checkpoint_writer.wait())
        if self.sharded is not None:
            self._beat("checkpoint")
            self._checkpoints_written(self.sharded.wait())

    def _checkpoints_written(self, records) -> None:
        for record in records:
            log.debug("checkpoint %s written in the background in %.3fs (training blocked %.3fs)",
                      record.path, record.write_s, record.snapshot_s)
            for callback in self.callbacks:
                callback.on_checkpoint_saved(self, record.path)

    def _restore(self, path: Path, state: dict[str, Any]) -> None:
        if not path.is_dir():  # a dcp folder's optimizer and EMA are loaded already
            if state["optimizer"] is not None:
                load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            if self.ema is not None and state["ema"] is not None:
                self.ema.load_state_dict(state["ema"])
        if self.scheduler and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        self.early = EarlyStoppingState(**state["early_stopping"])
        self.history = list(state.get("history", []))
        if self.resharding:
            self._reshard(path, self.resharding)
            return
        if "rng" in self._resumed_rank_part:
            restore_rng(self._resumed_rank_part["rng"])
        else:
            seed_everything(self.training.seed + self.ctx.rank)
            log.warning("checkpoint %s holds no RNG streams for rank %d: they start afresh", path, self.ctx.rank)
        if self.ctx.is_rank_zero:
            log.info("resuming from %s: epoch %d, batch %d, step %d", path, self.progress.epoch + 1,
                     self.progress.batches_done, self.progress.global_step)

    def _reshard(self, path: Path, change: Resharding) -> None:
        """Continue a checkpoint of another world size (or per-rank batch): the rest of the
        epoch dealt out over this one, the learning rate rescaled under ``lr_scaling: linear``."""
        self.progress = Progress(change.epoch, 0, change.global_step, change.position)
        # The saved RNG streams belong to the old ranks: new ones, per rank and step.
        seed_everything(self.training.seed + self.ctx.rank + 1_000_003 * change.global_step)
        factor = lr_factor(change, self.training.lr_scaling)
        rescale_lr(self.optimizer, self.scheduler, factor)
        if self.ctx.is_rank_zero:
            log.warning("resuming from %s, written by %d ranks, on %d: effective batch %d -> %d (%d x %d x %d); "
                        "%s; epoch %d continues after %d of its samples, the other %d dealt out over %d ranks; "
                        "step %d", path, change.old.world_size, change.new.world_size, change.old.effective_batch_size,
                        change.new.effective_batch_size, change.new.batch_size, change.new.world_size,
                        change.new.grad_accum_steps,
                        f"learning rate x {factor:.4g} (lr_scaling: linear)" if factor != 1.0
                        else f"learning rate kept (lr_scaling: {self.training.lr_scaling})",
                        change.epoch + 1, change.position, len(self.sampler.dataset) - change.position,
                        change.new.world_size, change.global_step)

    # ----- reporting ------------------------------------------------------------------------

    def _epoch_line(self, row: dict[str, Any]) -> str:
        metrics = "  ".join(f"{k} {v:.4f}" for k, v in row.items()
                            if k.startswith(("train_", "val_")) and isinstance(v, float))
        rate = f"{row['samples_per_s']:.0f} samples/s" if row.get("samples_per_s") else ""
        return (f"epoch {row['epoch']}/{self.training.epochs}  {metrics}  lr {row['lr']:.3g}  {rate}  "
                f"{row['epoch_time_s']:.2f}s")

    def _summary(self, started: float, status: RunStatus, test: dict[str, float] | None,
                 write: bool = True) -> RunSummary:
        gathered = self.ctx.all_gather_object((self.progress.epoch, parameter_checksum(self.model),
                                               state_bytes(self.model, self.optimizer)))
        epochs_per_rank = [epoch for epoch, _, _ in gathered]
        checksums = [checksum for _, checksum, _ in gathered]
        rates = [row["samples_per_s"] for row in self.history if row.get("samples_per_s")]
        metric = self.config.validation.early_stopping.metric
        summary = RunSummary(
            status=status,
            run_dir=str(self.run.path),
            job=self.config.job.name,
            epochs_completed=self.progress.epoch,
            global_step=self.progress.global_step,
            world_size=self.ctx.world_size,
            backend=self.ctx.device.backend,
            device=str(self.ctx.device.torch_device),
            effective_batch_size=self.effective_batch_size,
            samples_per_s=round(sum(rates) / len(rates), 2) if rates else None,
            wall_time_s=round(time.perf_counter() - started, 3),
            final=self.history[-1] if self.history else {},
            best={"epoch": self.early.best_epoch, metric: self.early.best} if self.early.best is not None else None,
            test=test,
            epochs_run_per_rank=epochs_per_rank,
            parameter_checksums_per_rank=checksums,
            state_bytes_per_rank=[size for _, _, size in gathered],
        )
        if self.ctx.is_rank_zero and write:
            self.run.write_summary(summary)
        return summary

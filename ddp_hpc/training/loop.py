"""The loop: epochs and steps, accumulation, the optimizer step, validation and test.

What it trains and saves is the ``TrainingState``; it uses the engine's parts as a loop of
one's own does: the ``Checkpointer`` saves at its cadence (``save_due`` after each step,
``epoch_done`` at each epoch's end), the ``StopAgreement`` decides a stop (a signal or the
deadline) after each step, the watchdog is beaten at every step, evaluation batch and
checkpoint. What else happens around a step (tracking, early stopping, ...) is the callbacks'.
Each of these is handed to it by name (the Trainer builds them); it never sees the Trainer
but as the ``TrainerView`` it passes on to the hooks.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from ddp_hpc.engine.watchdog import Watchdog
from ddp_hpc.training.callbacks import CallbackList, TrainerView, Verdict
from ddp_hpc.training.data import LoaderPlan, eval_loader, shard_padding_mask, train_loader
from ddp_hpc.training.job import Datasets, Job, StepOutput
from ddp_hpc.training.metrics import MetricSums

if TYPE_CHECKING:
    from ddp_hpc.config import Config
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.stop_agreement import StopAgreement
    from ddp_hpc.startup.distributed import DistContext
    from ddp_hpc.training.precision import Precision
    from ddp_hpc.training.run_folder import RunFolder
    from ddp_hpc.training.state import TrainingState

#: The lines users read in job logs keep the source name they always had.
log = logging.getLogger("ddp_hpc.training.trainer")


class TrainingLoop:
    """Trains ``state`` on ``datasets`` from where it stands. ``stop``: the stop every rank
    agrees on, asked after each step; ``run``: the run folder (rank 0 appends each epoch's
    row); ``recovery``: in-job recovery when it keeps the group (it counts the steps then);
    ``callbacks``: their hooks receive ``view`` (the Trainer), which the loop only hands on."""

    def __init__(self, job: Job, config: Config, ctx: DistContext, precision: Precision, state: TrainingState,
                 datasets: Datasets, *, callbacks: CallbackList, stop: StopAgreement, run: RunFolder,
                 recovery: InJobRecovery | None, view: TrainerView) -> None:
        self.job, self.config, self.ctx, self.precision = job, config, ctx, precision
        self.state, self.datasets, self.callbacks = state, datasets, callbacks
        self.stop, self.run_folder, self.recovery, self.view = stop, run, recovery, view
        self.training = config.training
        self.device = ctx.device.torch_device
        pin = self.config.data.pin_memory
        self.pin_memory = self.ctx.device.device_type == "cuda" if pin == "auto" else bool(pin)
        sampler = self.state.sampler
        self.loader = train_loader(datasets.train, sampler, self.training.batch_size, self.config.data,
                                   self.pin_memory)
        #: This epoch's micro-batches per rank (fewer in an epoch resumed on more ranks).
        self.plan = LoaderPlan(sampler.num_samples, self.training.batch_size, self.config.data.drop_last)
        #: The running sums of the epoch in progress (tracking reads them at each step).
        self.epoch_sums = MetricSums(self.device)
        #: Seconds of the last step's own work, outside any collective (its forward passes):
        #: what the watchdog's straggler check compares between ranks.
        self.step_compute_s = 0.0
        #: The ranks agreed to stop (a signal or the deadline).
        self.preempted = False
        #: The engine's watchdog while training runs under ``distributed.watchdog_s`` (the Trainer's ``fit``).
        self.watchdog: Watchdog | None = None
        #: Under in-job recovery: this rank's sums after the last two steps, by (epoch, step),
        #: so that the epoch continued after a recovery (from either) keeps what it summed.
        self._kept_sums: dict[tuple[int, int], MetricSums] = {}

    # ----- epochs -----------------------------------------------------------------------

    def run(self) -> str:
        """Train from where the state stands: "completed", "early_stopped" or "preempted"."""
        state, view, checkpointer = self.state, self.view, self.state.checkpointer
        while state.progress.epoch < self.training.epochs:
            epoch = state.progress.epoch
            epoch_started = time.perf_counter()
            train_metrics, samples = self._train_one_epoch(epoch)
            if state.progress.batches_done < self.plan.batches:
                # Stopped inside the epoch: the agreed stop saved it; max_steps: the last save.
                checkpointer.save()
                return "preempted" if self.preempted else "completed"
            elapsed = time.perf_counter() - epoch_started
            state.epoch_done()
            if state.scheduler and self.training.scheduler.interval == "epoch":
                state.scheduler.step()

            row: dict[str, Any] = {"epoch": epoch + 1, "step": state.progress.global_step,
                                   "lr": state.optimizer.param_groups[0]["lr"],
                                   "epoch_time_s": round(elapsed, 4),
                                   "samples_per_s": round(samples / elapsed, 2) if elapsed > 0 else None,
                                   **{f"train_{k}": v for k, v in train_metrics.items()}}
            verdict = Verdict()
            last_epoch = state.progress.epoch == self.training.epochs or self.reached_max_steps()
            val = self.datasets.val
            if val is not None and ((epoch + 1) % self.config.validation.every_n_epochs == 0 or last_epoch):
                val_metrics, _ = self.evaluate(val)
                row.update({f"val_{k}": v for k, v in val_metrics.items()})
                verdict = self.callbacks.on_validation_end(view, val_metrics, epoch + 1)
            state.history.append(row)
            if self.ctx.is_rank_zero:
                self.run_folder.append_metrics(row)
                log.info(self._epoch_line(row))
            checkpointer.epoch_done(epoch + 1, save=last_epoch or verdict.stop or verdict.improved,
                                    best=verdict.improved and self.config.checkpoint.save_best)
            self.stop.epoch_ended()
            self.callbacks.on_epoch_end(view, row)
            if self.preempted and not last_epoch:
                return "preempted"
            if verdict.stop:
                return "early_stopped"
            if self.reached_max_steps():
                return "completed"
        return "completed"

    def reached_max_steps(self) -> bool:
        return bool(self.training.max_steps) and self.state.progress.global_step >= self.training.max_steps

    def beat(self, phase: str) -> None:
        """Progress, at every step, evaluation batch and checkpoint: the watchdog's beat
        and the callbacks' ``on_progress``."""
        if self.watchdog is not None:
            self.watchdog.beat(phase, self.state.checkpointer.step,
                               self.step_compute_s if phase == "training" else None)
        self.callbacks.on_progress(self.view, phase)

    # ----- steps ------------------------------------------------------------------------

    def _train_one_epoch(self, epoch: int) -> tuple[dict[str, float], int]:
        state, sampler, checkpointer = self.state, self.state.sampler, self.state.checkpointer
        model = state.ddp_model
        model.train()
        sampler.set_epoch(epoch)  # a new epoch starts whole, the restored one where its checkpoint left it
        self.plan = LoaderPlan(sampler.num_samples, self.training.batch_size, self.config.data.drop_last)
        start_batch = sampler.batches_done
        sampler.skip_next(start_batch * self.training.batch_size)
        # Reseeded per epoch so a resumed epoch gives workers the same seeds as the original.
        self.loader.generator.manual_seed(self.training.seed * 1_000_003 + epoch)
        accum, total_batches = self.training.grad_accum_steps, self.plan.batches
        kept = self._kept_sums.get((epoch, state.progress.global_step)) if start_batch else None
        sums = self.epoch_sums = kept.copy() if kept is not None else MetricSums(self.device)
        recovery = self.recovery
        batch_index = start_batch
        forward_s = 0.0
        for batch in self._progress_bar(self.loader, epoch, start_batch, total_batches):
            window_start = (batch_index // accum) * accum
            window = min(accum, total_batches - window_start)
            closes_window = batch_index + 1 == window_start + window
            sync = closes_window or not isinstance(model, DistributedDataParallel)
            batch = self.job.move_batch(batch, self.device, non_blocking=self.pin_memory)
            with nullcontext() if sync else model.no_sync():
                forward_started = time.perf_counter()
                with self.precision.autocast():
                    output = self.job.training_step(model, batch)
                forward_s += time.perf_counter() - forward_started
                state.scaler.scale(output.loss / window).backward()
            sums.add(self._per_sample(output))
            batch_index += 1
            if not closes_window:
                continue
            self._optimizer_step()
            if recovery is not None:  # counts through the Checkpointer too, and keeps this step's RNG streams
                recovery.step_done(batch_index - sampler.batches_done, epoch_ends=batch_index == total_batches,
                                   save=False)
                self._keep_sums(epoch, state.progress.global_step, sums)
            else:
                checkpointer.step_done(batch_index - sampler.batches_done, epoch_ends=batch_index == total_batches,
                                       save=False)
            self.step_compute_s, forward_s = forward_s, 0.0
            step = state.progress.global_step
            self.beat("training")
            self.callbacks.on_step_end(self.view)
            self._maybe_log_step(sums, step)
            checkpointer.save_due()  # after the callbacks: their state of this step is in it
            if self.stop.now(steps_left_in_epoch=math.ceil((total_batches - batch_index) / accum), quiet=True):
                self.preempted = True
                break
            if self.reached_max_steps():
                break
        return sums.reduce(self.ctx)

    def _keep_sums(self, epoch: int, step: int, sums: MetricSums) -> None:
        self._kept_sums = {key: kept for key, kept in self._kept_sums.items() if key == (epoch, step - 1)}
        self._kept_sums[(epoch, step)] = sums.copy()

    @staticmethod
    def _per_sample(output: StepOutput) -> dict[str, torch.Tensor]:
        if output.per_sample:
            return output.per_sample
        return {"loss": output.loss.detach().reshape(1)}

    def _optimizer_step(self) -> None:
        state = self.state
        if self.training.grad_clip_norm:
            state.scaler.unscale_(state.optimizer)
            torch.nn.utils.clip_grad_norm_(state.model.parameters(), self.training.grad_clip_norm)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)
        if state.ema is not None:
            state.ema.update_parameters(state.model)
        if state.scheduler and self.training.scheduler.interval == "step":
            state.scheduler.step()

    def _progress_bar(self, loader, epoch: int, start: int, total: int):
        mode = self.config.logging.progress
        show = self.ctx.is_rank_zero and (mode == "always" or (mode == "auto" and sys.stderr.isatty()))
        if not show:
            return loader
        from tqdm import tqdm

        return tqdm(loader, total=total, initial=start, desc=f"epoch {epoch + 1}/{self.training.epochs}",
                    leave=False, dynamic_ncols=True, file=sys.stderr)

    def _maybe_log_step(self, sums: MetricSums, step: int) -> None:
        every = self.config.logging.log_every_n_steps
        if every and step % every == 0 and self.ctx.is_rank_zero:
            loss = sums.sums.get("loss")
            if loss is not None:
                log.info("step %d: train loss (this rank, epoch so far) %.4f", step, float(loss / sums.count))

    # ----- validation and test ----------------------------------------------------------

    def evaluate(self, dataset: Dataset) -> tuple[dict[str, float], int]:
        """Metrics over ``dataset``, each sample counted exactly once across ranks."""
        state = self.state
        model = state.ema.module if state.ema is not None else state.model
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
                self.beat("evaluation")
        model.train(was_training)
        metrics, count = sums.reduce(self.ctx)
        if count != len(dataset):
            raise RuntimeError(f"evaluation counted {count} samples of {len(dataset)}")
        return metrics, count

    def test(self) -> dict[str, float] | None:
        if self.datasets.test is None:
            return None
        metrics, count = self.evaluate(self.datasets.test)
        self.callbacks.on_test_end(self.view, metrics)
        if self.ctx.is_rank_zero:
            log.info("test: %s (%d samples)", "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())), count)
        return metrics

    def _epoch_line(self, row: dict[str, Any]) -> str:
        metrics = "  ".join(f"{k} {v:.4f}" for k, v in row.items()
                            if k.startswith(("train_", "val_")) and isinstance(v, float))
        rate = f"{row['samples_per_s']:.0f} samples/s" if row.get("samples_per_s") else ""
        return (f"epoch {row['epoch']}/{self.training.epochs}  {metrics}  lr {row['lr']:.3g}  {rate}  "
                f"{row['epoch_time_s']:.2f}s")

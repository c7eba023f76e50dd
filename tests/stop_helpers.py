"""A job and callbacks for stop/resume tests, named in test configs (tests/ is on PYTHONPATH).

- ``RecordingJob``: trains on sample ids; with ``RecordIds`` every rank appends the ids it
  trained, with their epoch, to a file of its own, so a test can count every sample.
- ``StopAtStep``: one rank (0 unless told) asks for the agreed stop at a step, as a signal
  handler would.
- ``SlowSteps``: each step takes longer, standing in for a job long enough to meet its deadline.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_hpc.training import Callback, Datasets, Job, StepOutput


class RecordingJob(Job):
    """A linear model on ``size`` samples whose inputs are their ids; ``hidden``: a hidden
    layer of that width (tensors that split over the ranks under fsdp2)."""

    def __init__(self, size: int = 60, hidden: int = 0) -> None:
        self.size = size
        self.hidden = hidden
        self.pending: list[int] = []

    def build_model(self) -> nn.Module:
        if self.hidden:
            return nn.Sequential(nn.Linear(1, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))
        return nn.Linear(1, 1)

    def build_datasets(self) -> Datasets:
        ids = torch.arange(self.size, dtype=torch.float32).unsqueeze(1)
        return Datasets(train=TensorDataset(ids, ids * 0.5 + 1))

    def training_step(self, model, batch) -> StepOutput:
        ids, target = batch
        self.pending.extend(ids.squeeze(1).long().tolist())
        loss = nn.functional.mse_loss(model(ids / self.size), target / self.size, reduction="none").squeeze(1)
        return StepOutput(loss.mean(), {"loss": loss.detach()})


class RecordIds(Callback):
    """After every step, append ``epoch id`` lines for the samples this rank trained in it."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_step_end(self, trainer) -> None:
        job = trainer.job
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{trainer.ctx.rank}-{os.getpid()}.txt", "a") as handle:
            handle.write("".join(f"{trainer.progress.epoch} {i}\n" for i in job.pending))
        job.pending.clear()


def count_ids(*folders: Path) -> dict[int, Counter]:
    """epoch -> Counter of sample ids over every record file in ``folders``."""
    counts: dict[int, Counter] = {}
    for folder in folders:
        for path in folder.glob("rank*.txt"):
            for line in path.read_text().splitlines():
                epoch, sample = map(int, line.split())
                counts.setdefault(epoch, Counter())[sample] += 1
    return counts


class StopAtStep(Callback):
    """Rank ``rank`` alone requests the agreed stop after ``step``."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, trainer) -> None:
        if trainer.ctx.rank == self.rank and trainer.progress.global_step == self.step:
            trainer.request_stop()


class SlowSteps(Callback):
    """Every step takes ``seconds`` longer (the numbers it computes do not change)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, trainer) -> None:
        time.sleep(self.seconds)


class SlowFirstAttempt(SlowSteps):
    """``SlowSteps`` in a job's first run only: a requeued SLURM job (SLURM_RESTART_COUNT > 0)
    runs at full speed, so the same rendered script can overrun its time limit once."""

    def on_step_end(self, trainer) -> None:
        if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            super().on_step_end(trainer)


class DeafToStopSignals(Callback):
    """In a job's first run (SLURM_RESTART_COUNT 0): the ranks ignore every stop signal from
    the start of training, and a request one made during start-up is withdrawn, so that only
    the job's deadline ($DDP_HPC_DEADLINE) can stop them."""

    def on_fit_start(self, trainer) -> None:
        import signal

        from ddp_hpc.stop import parse_stop_signal, stop_signals

        if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
            return
        for signum in stop_signals(parse_stop_signal(trainer.config.checkpoint.stop_signal)):
            signal.signal(signum, signal.SIG_IGN)
        trainer.stop.requested = False

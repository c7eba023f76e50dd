"""An example of your own Job, loaded by path: `job.name: jobs/my_job.py:SineJob`.

Copy this file to start a job of your own. It fits y = sin(x) with a small MLP on data it
makes itself (no download). Run it on 2 local ranks with:

    torchrun --nproc_per_node 2 -m ddp_hpc train configs/my_job.yaml
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_hpc import Datasets, Job, StepOutput


class SineJob(Job):
    def __init__(self, samples: int = 2048, hidden: int = 64) -> None:
        self.samples, self.hidden = samples, hidden

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(1, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def build_datasets(self) -> Datasets:
        generator = torch.Generator().manual_seed(0)  # the same data on every rank
        x = torch.rand(self.samples, 1, generator=generator) * 2 * math.pi - math.pi
        y = torch.sin(x)
        split = self.samples * 3 // 4
        return Datasets(train=TensorDataset(x[:split], y[:split]), val=TensorDataset(x[split:], y[split:]))

    def training_step(self, model: nn.Module, batch) -> StepOutput:
        x, y = batch
        errors = (model(x) - y).pow(2).squeeze(1)  # per-sample squared errors
        return StepOutput(errors.mean(), {"mse": errors.detach()})

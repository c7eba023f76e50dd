"""Pairwise preference learning (Bradley-Terry), to show a custom step.

Each sample is a pair of items (a, b) and which one a hidden utility prefers. The model
scores items one at a time; the loss is -log sigmoid(score(winner) - score(loser)). The
batch is not (inputs, targets) and the loss is not cross-entropy, so the job overrides
``training_step``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_hpc.training.job import Batch, Datasets, Job, StepOutput


class PreferenceJob(Job):
    def __init__(self, pairs: int = 4096, val_pairs: int = 512, features: int = 32, hidden: int = 64,
                 noise: float = 0.1, data_seed: int = 7) -> None:
        self.pairs, self.val_pairs, self.features, self.hidden = pairs, val_pairs, features, hidden
        self.noise, self.data_seed = noise, data_seed

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.features, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def build_datasets(self) -> Datasets:
        generator = torch.Generator().manual_seed(self.data_seed)
        utility = torch.randn(self.features, generator=generator)

        def pairs(count: int) -> TensorDataset:
            a = torch.randn(count, self.features, generator=generator)
            b = torch.randn(count, self.features, generator=generator)
            margin = (a - b) @ utility + self.noise * torch.randn(count, generator=generator)
            return TensorDataset(a, b, (margin > 0).float())

        return Datasets(train=pairs(self.pairs), val=pairs(self.val_pairs))

    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        a, b, a_preferred = batch
        # One forward pass over both items keeps DDP's hooks to a single backward.
        scores = model(torch.cat([a, b])).squeeze(-1)
        score_a, score_b = scores.chunk(2)
        sign = 2 * a_preferred - 1
        losses = -nn.functional.logsigmoid(sign * (score_a - score_b))
        agree = ((score_a > score_b).float() == a_preferred).float()
        return StepOutput(losses.mean(), {"loss": losses.detach(), "pair_accuracy": agree})

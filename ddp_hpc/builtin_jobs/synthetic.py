"""A compute-bound MLP on generated data, with size knobs, for benchmarks and tests.

Inputs are Gaussian; labels come from a fixed random "teacher" network, so there is
something to learn and runs are reproducible. Nothing is read from disk.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_hpc.training.job import Datasets, Job


def make_mlp(input_dim: int, hidden: int, depth: int, classes: int, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = input_dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class SyntheticJob(Job):
    def __init__(self, samples: int = 4096, val_samples: int = 512, test_samples: int = 0,
                 input_dim: int = 256, hidden: int = 512, depth: int = 4, classes: int = 10,
                 dropout: float = 0.0, data_seed: int = 1234) -> None:
        self.samples, self.val_samples, self.test_samples = samples, val_samples, test_samples
        self.input_dim, self.hidden, self.depth, self.classes = input_dim, hidden, depth, classes
        self.dropout, self.data_seed = dropout, data_seed

    def build_model(self) -> nn.Module:
        return make_mlp(self.input_dim, self.hidden, self.depth, self.classes, self.dropout)

    def build_datasets(self) -> Datasets:
        generator = torch.Generator().manual_seed(self.data_seed)
        teacher = make_mlp(self.input_dim, 64, 2, self.classes)
        with torch.no_grad():
            for parameter in teacher.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

        def split(count: int) -> TensorDataset | None:
            if count == 0:
                return None
            inputs = torch.randn(count, self.input_dim, generator=generator)
            with torch.no_grad():
                labels = teacher(inputs).argmax(dim=1)
            return TensorDataset(inputs, labels)

        return Datasets(train=split(self.samples), val=split(self.val_samples), test=split(self.test_samples))

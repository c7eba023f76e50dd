"""A small CNN on scikit-learn's bundled 8x8 digits (1,797 real images, no download).

The embedded default main job: `scripts/run_ddp_local.sh` trains it on 2 CPU ranks to a
test accuracy of about 0.97 in well under a minute.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_hpc.errors import UserError
from ddp_hpc.training.job import Datasets, Job


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``load_digits()`` gives them (images (1797, 8, 8) float64,
    target int), read from the data file it ships, without importing scikit-learn: that
    import (scipy.stats and more) cost every rank about 1.4 s of CPU, more than the load."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None:
        raise UserError("the digits job needs scikit-learn: pip install 'ddp_hpc[examples]'")
    for location in spec.submodule_search_locations or ():
        data_file = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if data_file.is_file():
            # What sklearn.datasets.load_digits does with the same file.
            data = np.loadtxt(data_file, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    try:  # a scikit-learn that keeps the file elsewhere
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise UserError(f"the digits job cannot import scikit-learn ({error}): "
                        "pip install 'ddp_hpc[examples]'") from None
    digits = load_digits()
    return digits.images, digits.target


class DigitsCNN(nn.Module):
    def __init__(self, channels: int = 16, hidden: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * channels * 16, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, 10),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


class DigitsJob(Job):
    def __init__(self, channels: int = 16, hidden: int = 64, dropout: float = 0.0,
                 val_fraction: float = 0.1, test_fraction: float = 0.2, split_seed: int = 0,
                 data_path: str | None = None) -> None:
        if not 0 < val_fraction + test_fraction < 1:
            raise UserError("job.params: val_fraction + test_fraction must be in (0, 1)")
        self.channels, self.hidden, self.dropout = channels, hidden, dropout
        self.val_fraction, self.test_fraction, self.split_seed = val_fraction, test_fraction, split_seed
        self.data_path = data_path

    def build_model(self) -> nn.Module:
        return DigitsCNN(self.channels, self.hidden, self.dropout)

    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        """scikit-learn's bundled digits, or ``data_path``: an .npz with ``images`` (N, 8, 8,
        values 0-16) and ``target`` (N,)."""
        if self.data_path is not None:
            try:
                with np.load(self.data_path) as data:
                    return data["images"], data["target"]
            except (OSError, ValueError, KeyError) as exc:
                raise UserError(f"job.params.data_path {self.data_path!r} cannot be read as an .npz with "
                                f"'images' and 'target': {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                                ) from None
        return bundled_digits()

    def build_datasets(self) -> Datasets:
        raw_images, raw_labels = self._load()
        images = torch.tensor(raw_images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(raw_labels, dtype=torch.long)
        # A fixed split, the same on every rank and in every run.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        n_test = int(len(labels) * self.test_fraction)
        n_val = int(len(labels) * self.val_fraction)
        test, val, train = order[:n_test], order[n_test:n_test + n_val], order[n_test + n_val:]
        return Datasets(
            train=TensorDataset(images[train], labels[train]),
            val=TensorDataset(images[val], labels[val]),
            test=TensorDataset(images[test], labels[test]),
        )

"""Samplers and loaders: a shard per rank, a new order per epoch, resumable mid-epoch."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_hpc.config import DataConfig
from ddp_hpc.training.reshard import epoch_order, shard_rest


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start its next pass ``skip`` samples in.

    The permutation depends only on (seed, epoch), never on the world size, so the union
    of the ranks' k-th batches is the same global batch at any world size, and resuming
    at (epoch, position) replays exactly the samples an uninterrupted run would see.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, *, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=False)
        self._skip = 0
        self._position = 0

    def start_epoch_at(self, position: int) -> None:
        """This epoch covers positions ``position``... of the order only, dealt out over this
        world size: the rest of an epoch begun at another one (0: the whole epoch)."""
        size = len(self.dataset)
        if not 0 <= position < size:
            raise ValueError(f"epoch position {position} is outside a training set of {size}")
        self._position = position
        self.num_samples = math.ceil((size - position) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def skip_next(self, samples: int) -> None:
        """The next pass starts ``samples`` into this rank's shard (then resets to 0)."""
        self._skip = max(0, min(samples, self.num_samples))

    def __iter__(self) -> Iterator[int]:
        if self._position:
            order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
            indices = shard_rest(order, self._position, self.rank, self.num_replicas)
        else:
            indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])

    def __len__(self) -> int:
        return self.num_samples - self._skip


def shard_padding_mask(batch_start: int, batch_len: int, rank: int, world_size: int,
                       dataset_len: int, device: torch.device) -> torch.Tensor:
    """True for the real samples of an evaluation batch, False for DistributedSampler's padding.

    Without shuffling, rank r's j-th sample is position r + j * world_size of the padded
    index list, and positions from ``dataset_len`` on are repeats added to even out the
    shards: they must not count twice.
    """
    positions = rank + (batch_start + torch.arange(batch_len, device=device)) * world_size
    return positions < dataset_len


@dataclass(frozen=True)
class LoaderPlan:
    """How many micro-batches each rank sees per epoch (equal on every rank)."""

    samples_per_rank: int
    batch_size: int
    drop_last: bool

    @property
    def batches(self) -> int:
        full, rest = divmod(self.samples_per_rank, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1


def _loader_kwargs(data: DataConfig, pin_memory: bool) -> dict:
    kwargs: dict = {"num_workers": data.num_workers, "pin_memory": pin_memory}
    if data.num_workers > 0:
        kwargs["persistent_workers"] = data.persistent_workers
        if data.prefetch_factor is not None:
            kwargs["prefetch_factor"] = data.prefetch_factor
    return kwargs


def train_loader(dataset: Dataset, sampler: ResumableDistributedSampler, batch_size: int,
                 data: DataConfig, pin_memory: bool) -> DataLoader:
    # A generator of its own (the trainer reseeds it every epoch): otherwise each new
    # iterator draws its base seed from the global RNG, and a resumed epoch would shift
    # every later random number.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=data.drop_last,
                      generator=torch.Generator(), **_loader_kwargs(data, pin_memory))


def eval_loader(dataset: Dataset, rank: int, world_size: int, batch_size: int, data: DataConfig,
                pin_memory: bool) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False,
                      **_loader_kwargs(data, pin_memory))

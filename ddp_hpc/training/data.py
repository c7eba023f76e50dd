"""The Trainer's loaders (their resumable order is ``ddp_hpc.engine.sampler``) and evaluation masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_hpc.config import DataConfig
from ddp_hpc.engine.sampler import ResumableSampler


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


def train_loader(dataset: Dataset, sampler: ResumableSampler, batch_size: int,
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

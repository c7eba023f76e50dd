"""The data order: a shard per rank, a new order per epoch, resumable mid-epoch, and
resumable on another world size with every sample of the interrupted epoch trained once
(but the few that pad the rest to a multiple of the new world size: ``repeated``).

The permutation depends only on (seed, epoch), never on the world size (see
``ddp_hpc.engine.reshard``). The Trainer moves the sampler itself (``start_epoch_at``,
``skip_next``); a loop of one's own tells it of each step (``advance``, which the
``Checkpointer`` calls) and hands it to the ``Checkpointer``, which saves and restores
it with ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from ddp_hpc.engine.reshard import epoch_order, shard_rest

log = logging.getLogger(__name__)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch part-way in, on any world size.

    ``batch_size`` (the DataLoader's, per rank) is needed only to save and restore the
    position inside an epoch (``state_dict``); ``drop_last_batch`` says that the DataLoader
    drops a last, partial batch (``drop_last=True``), so that an epoch ends one batch sooner.
    Without ``num_replicas``/``rank`` it deals to the process group's ranks, or to this one
    process alone where no group is initialized (as ``process_group()`` runs a single process).
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None, *,
                 shuffle: bool = True, seed: int = 0, batch_size: int | None = None,
                 drop_last_batch: bool = False) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            num_replicas = 1 if num_replicas is None else num_replicas
            rank = 0 if rank is None else rank
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=False)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.batch_size = batch_size
        self.drop_last_batch = drop_last_batch
        self._skip = 0
        self._position = 0
        #: Batches of this epoch trained on this rank (``advance``), for ``state_dict``.
        self.batches_done = 0

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

    # ----- saved and restored by a Checkpointer ------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Like ``DistributedSampler.set_epoch``; a new epoch starts whole, the restored one
        where the checkpoint left it."""
        if epoch != self.epoch:
            if self._position:
                self.start_epoch_at(0)
            self._skip, self.batches_done = 0, 0
        super().set_epoch(epoch)

    def advance(self, batches: int = 1) -> None:
        """``batches`` more batches of this epoch were trained (the Checkpointer calls it every step)."""
        self.batches_done += batches

    @property
    def repeated(self) -> int:
        """Samples of this epoch's (rest of the) order dealt twice: every rank gets as many
        (DDP's collectives need that), so where they do not divide over the ranks, the first
        few repeat, as ``DistributedSampler`` pads (at most ``num_replicas - 1``)."""
        return self.total_size - (len(self.dataset) - self._position)

    @property
    def epoch_offset(self) -> int:
        """Positions of this epoch's order trained before this pass (at another world size)."""
        return self._position

    def resume_at(self, position: int) -> None:
        """Continue this epoch after the first ``position`` positions of its order, dealt
        out over this world size (what resuming on another world size does)."""
        self.start_epoch_at(position)
        self._skip, self.batches_done = 0, 0

    def _batches_in_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self._need_batch_size())
        return full if self.drop_last_batch or rest == 0 else full + 1

    def _need_batch_size(self) -> int:
        if self.batch_size is None:
            raise ValueError("ResumableSampler needs batch_size= (the DataLoader's) to save its position")
        return self.batch_size

    def progress(self) -> dict[str, int]:
        """The epoch, the batches of it trained on each rank, and the positions of its order
        trained at another world size before (a finished epoch is the start of the next)."""
        epoch, done, offset = self.epoch, self.batches_done, self._position
        if done >= self._batches_in_epoch():
            epoch, done, offset = epoch + 1, 0, 0
        return {"epoch": epoch, "batches_done": done, "epoch_offset": offset}

    def state_dict(self) -> dict[str, Any]:
        """Where the data order stands: ``progress()``, and what it needs to continue."""
        return {**self.progress(), "world_size": self.num_replicas, "batch_size": self._need_batch_size(),
                "seed": self.seed, "shuffle": self.shuffle, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` left off: the same batches on the same world size and
        batch size, else the rest of the epoch dealt out over this world size."""
        if int(state["dataset_len"]) != len(self.dataset):
            raise ValueError(f"the sampler's checkpoint is of a dataset of {state['dataset_len']} samples, "
                             f"this one has {len(self.dataset)}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        super().set_epoch(int(state["epoch"]))
        old_world, old_batch = int(state["world_size"]), int(state["batch_size"])
        offset, done = int(state["epoch_offset"]), int(state["batches_done"])
        if (old_world, old_batch) == (self.num_replicas, self._need_batch_size()):
            self.start_epoch_at(offset)
            self.skip_next(done * old_batch)
            self.batches_done = done
            return
        position = offset + done * old_batch * old_world
        self.resume_at(position)
        if self.rank == 0:
            log.warning("data order saved by %d ranks of batch %d continues on %d ranks of batch %d: epoch %d "
                        "(sampler.epoch, counted from 0) goes on after %d of its samples", old_world, old_batch,
                        self.num_replicas, self._need_batch_size(), self.epoch, position)

"""Callbacks for the fsdp2 resume test (tests/ is on PYTHONPATH of its ranks):
``RecordLosses`` records the whole training set's loss after every step of ``RecordingJob``;
``RecordRestored`` what a run holds when it starts training (after its restore)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ddp_hpc.training import Callback


class RecordLosses(Callback):
    """After every step, the loss of the whole training set (every rank computes it: under
    fsdp2 a forward is collective); rank 0 appends ``global_step loss`` to a file per process."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_step_end(self, trainer) -> None:
        inputs, targets = trainer.job.build_datasets().train.tensors
        size = trainer.job.size
        with torch.no_grad():
            loss = float(nn.functional.mse_loss(trainer.model(inputs / size), targets / size))
        if trainer.ctx.is_rank_zero:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"losses-{os.getpid()}.txt", "a") as handle:
                handle.write(f"{trainer.progress.global_step} {loss!r}\n")


def read_losses(folder: Path) -> dict[int, float]:
    """global step -> rank 0's loss at that step, over every file in ``folder``."""
    losses: dict[int, float] = {}
    for path in folder.glob("losses-*.txt"):
        for line in path.read_text().splitlines():
            step, loss = line.split()
            losses[int(step)] = float(loss)
    return losses


class RecordRestored(Callback):
    """When training starts (after the restore): rank 0 saves the whole model and optimizer
    state, gathered from every rank's shards, to ``FOLDER/restored-W.pt`` (W: the world
    size), and every rank writes the shape of its own part of each parameter to
    ``FOLDER/shapes-W-R.json``. An optimizer without state yet (a fresh start) is left
    alone: gathering it would first take a zero step, which counts in Adam's ``step``."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_fit_start(self, trainer) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        model, optimizer = trainer.model, trainer.optimizer
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        whole = (get_model_state_dict(model, options=options),
                 get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else None)
        world, rank = trainer.ctx.world_size, trainer.ctx.rank
        self.folder.mkdir(parents=True, exist_ok=True)
        shapes = {name: list(getattr(p, "_local_tensor", p).shape) for name, p in model.named_parameters()}
        (self.folder / f"shapes-{world}-{rank}.json").write_text(json.dumps(shapes))
        if trainer.ctx.is_rank_zero:
            torch.save({"model": whole[0], "optimizer": whole[1]}, self.folder / f"restored-{world}.pt")

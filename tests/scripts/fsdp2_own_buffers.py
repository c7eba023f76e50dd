"""An FSDP2 model whose buffers each rank's forward updates (BatchNorm's running statistics in a
sharded unit, a count on the root), checkpointed with ``Checkpointer(format=FORMAT)`` on every
rank of ``ddp-hpc launch --nproc N`` and restored into a fresh model, for
tests/test_sharded_mistakes.py. Each rank trains on data of its own, so its buffers are its own
(FSDP2 reduces gradients, never buffers). Each rank writes OUT/rank-R.json: for each buffer,
whether what it restored equals, bit for bit, what this rank held at the save, and whether
the ranks' buffers differed at all. OUT (the environment) is the run folder too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer


class Counted(nn.Sequential):
    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.detach().abs().mean(0)
        return super().forward(x)


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Counted(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU()), nn.Linear(16, 3))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    out, form = Path(os.environ["OUT"]), os.environ.get("FORMAT", "file")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = sharded(0)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 8) * (1 + rank)), torch.randn(4, 3)).backward()
        optimizer.step()
    Checkpointer(out, {"model": model, "optimizer": optimizer}, format=form).save(wait=True)
    held = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    theirs = [None] * dist.get_world_size()
    dist.all_gather_object(theirs, {name: value.tolist() for name, value in held.items()})

    fresh, fresh_optimizer = sharded(7)
    Checkpointer(out, {"model": fresh, "optimizer": fresh_optimizer}, format=form).restore()
    same = {name: torch.equal(held[name], buffer) for name, buffer in fresh.named_buffers()}
    differ = any(other != theirs[0] for other in theirs[1:])
    (out / f"rank-{rank}.json").write_text(json.dumps({"same": same, "ranks_differ": differ}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

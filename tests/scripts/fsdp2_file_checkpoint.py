"""An FSDP2 model checkpointed with ``Checkpointer(format="file")`` and restored, on every
rank of ``ddp-hpc launch --nproc N``, for tests/test_sharded_mistakes.py.

A model (two blocks sharded as units, a head the sharded root owns) and its AdamW train two steps
and are saved in one file; a fresh model and optimizer of other initial weights, sharded
alike, restore it. Each rank writes OUT/rank-R.json: for each parameter and each of its
optimizer state's tensors, whether what it restored equals, bit for bit, its own slice
of what was saved. OUT (the environment) is the run folder too.
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


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Sequential(nn.Linear(16, 16), nn.GELU()),
                          nn.Linear(16, 3))
    for unit in (model[0], model[1]):  # the head is the root's own
        fully_shard(unit)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def local(tree):
    if hasattr(tree, "to_local"):
        return tree.to_local().detach().clone()
    if isinstance(tree, dict):
        return {key: local(value) for key, value in tree.items()}
    return tree


def main() -> None:
    out = Path(os.environ["OUT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = sharded(0)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 3)).backward()
        optimizer.step()
    Checkpointer(out, {"model": model, "optimizer": optimizer}, format="file").save(wait=True)
    saved = {"model": local(model.state_dict()), "optimizer": local(optimizer.state_dict()["state"])}

    fresh, fresh_optimizer = sharded(7)
    Checkpointer(out, {"model": fresh, "optimizer": fresh_optimizer}, format="file").restore()
    restored = {"model": local(fresh.state_dict()), "optimizer": local(fresh_optimizer.state_dict()["state"])}
    same = {f"model/{name}": torch.equal(tensor, restored["model"][name]) for name, tensor in saved["model"].items()}
    for index, state in saved["optimizer"].items():
        for key, tensor in state.items():
            same[f"optimizer/{index}/{key}"] = torch.equal(tensor, restored["optimizer"][index][key])
    (out / f"rank-{rank}.json").write_text(json.dumps(same))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A small FSDP2 loop under ``InJobRecovery`` with one mistake a user can make with a
sharded model, named by MISTAKE, for tests/test_sharded_mistakes.py. Every rank prints
"rank R: step N" after each step, so a mistake let through shows as a step taken.

- none: the loop as docs/api.md shows it (two blocks and the root sharded, the optimizer
  built after ``fully_shard``).
- root_not_sharded: the blocks are sharded and the root, which owns the head, is not.
- optimizer_before_shard: the optimizer is built over the parameters before ``fully_shard``.
- shard_before_recovery: ``fully_shard`` runs before ``InJobRecovery`` (it starts the
  default group itself).
- ddp_wrap: ``run`` is given a ``wrap`` that puts DDP around the sharded model.
- ddp_around: ``run`` is given DDP around the sharded model (built with ``init_sync=False``:
  DDP's own start-up broadcast fails on a sharded model before ddp_hpc is called).
- scheduler_outside: an LR scheduler is built on the optimizer before ``run`` and left out
  of the Checkpointer's objects (as docs/api.md's "Your own loop" does for restarts): under
  ``--recover`` it would not travel to a replacement.

RUN_DIR: the run folder (default: a temporary one). CHECKPOINTER=file|dcp: a ``Checkpointer``
of that format holding model and optimizer is made before ``run`` (and given to it).
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
from ddp_hpc.engine.recovery import InJobRecovery

MISTAKE = os.environ.get("MISTAKE", "none")


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Sequential(nn.Linear(16, 16), nn.GELU()),
                         nn.Linear(16, 2))


def shard(model: nn.Module, *, root: bool = True) -> None:
    for block in (model[0], model[1]):
        fully_shard(block)
    if root:
        fully_shard(model)


def main() -> None:
    run_dir = os.environ.get("RUN_DIR") or tempfile.mkdtemp()
    model = build()
    if MISTAKE == "shard_before_recovery":
        shard(model)
    recovery = InJobRecovery("gloo", run_dir=run_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if MISTAKE == "optimizer_before_shard" else None
    if MISTAKE != "shard_before_recovery":
        shard(model, root=MISTAKE != "root_not_sharded")
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    given = DistributedDataParallel(model, init_sync=False) if MISTAKE == "ddp_around" else model
    wrap = DistributedDataParallel if MISTAKE == "ddp_wrap" else None
    checkpointer = None
    if os.environ.get("CHECKPOINTER"):
        checkpointer = Checkpointer(run_dir, {"model": model, "optimizer": optimizer},
                                    format=os.environ["CHECKPOINTER"])
    if MISTAKE == "scheduler_outside":
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=3)
    torch.manual_seed(1 + recovery.slot)
    inputs, targets = torch.randn(4, 8), torch.randn(4, 2)

    def train(sharded: nn.Module) -> None:
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.mse_loss(sharded(inputs), targets).backward()
            optimizer.step()
            recovery.step_done()
            print(f"rank {recovery.slot}: step {recovery.step}", flush=True)

    recovery.run(train, model=given, optimizer=optimizer, wrap=wrap, checkpointer=checkpointer)
    recovery.close()


if __name__ == "__main__":
    main()

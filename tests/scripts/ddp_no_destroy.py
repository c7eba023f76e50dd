"""A torchrun-style DDP script that trains a few steps and leaves the process group to
interpreter exit, as the Hugging Face Trainer does: it never calls destroy_process_group.

Under plain torchrun this now and then aborts in gloo's teardown ("terminate called
without an active exception", exit 134); under ``ddp-hpc run`` it must end with exit 0.
With ``NO_DESTROY_RAISE_ON_RANK=N``, rank N raises halfway through training.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("NO_DESTROY_STEPS", "20"))
RAISE_ON_RANK = os.environ.get("NO_DESTROY_RAISE_ON_RANK")

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(STEPS):
    if RAISE_ON_RANK is not None and dist.get_rank() == int(RAISE_ON_RANK) and step == STEPS // 2:
        # Mid-training: the other ranks are left waiting in this step's all-reduce.
        raise RuntimeError(f"rank {dist.get_rank()} fails on purpose at step {step}")
    optimizer.zero_grad()
    x = torch.randn(16, 32)
    nn.functional.cross_entropy(model(x), torch.randint(0, 4, (16,))).backward()
    optimizer.step()
print(f"rank {dist.get_rank()} trained {STEPS} steps\n", end="", flush=True)

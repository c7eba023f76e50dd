"""A DDP-style model whose ranks hold other BatchNorm statistics (each rank's forward updates
its own), saved by a dcp Checkpointer and restored into a fresh model: argv[1] is the run
folder. Each rank prints its restored running mean's first value."""

import sys

import torch
import torch.distributed as dist
from torch import nn

import ddp_hpc

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
with torch.no_grad():
    model[1].running_mean.fill_(float(rank + 1))  # as after each rank's own forwards
checkpointer = ddp_hpc.Checkpointer(sys.argv[1], {"model": model}, format="dcp")
checkpointer.save(wait=True)
fresh = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
ddp_hpc.Checkpointer(sys.argv[1], {"model": fresh}, format="dcp").restore()
print(f"restored rank {rank}: {float(fresh[1].running_mean[0])}", flush=True)
dist.destroy_process_group()

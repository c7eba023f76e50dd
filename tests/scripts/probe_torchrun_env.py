"""Print, as one JSON line, what a torchrun-aware framework would read on this rank, and
what a process group formed from those variables alone (env://) sums in an all_reduce."""

import datetime
import json
import os
import socket

import torch
import torch.distributed as dist

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "DDP_HPC_DEVICE",
         "DDP_HPC_BACKEND")
record = {name: os.environ.get(name) for name in NAMES}
# Lightning's TorchElasticEnvironment.detected(): these four variables present.
record["lightning_torchelastic"] = {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= set(os.environ)
record["is_torchelastic_launched"] = dist.is_torchelastic_launched()
record["slurm_node"] = os.environ.get("SLURMD_NODENAME")
record["slurm"] = {name: os.environ.get(name) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")}
record["host"] = socket.gethostname()
# env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT only; a rank that cannot join fails in a minute.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
ranks_plus_one = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(ranks_plus_one)
record["all_reduce_of_rank_plus_one"] = int(ranks_plus_one)
dist.destroy_process_group()
print(json.dumps(record), flush=True)

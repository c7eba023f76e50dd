"""A user's loop in which one rank skips one all_reduce (a collective under a condition
only some ranks meet), then every rank ends with a barrier: the hang the watchdog must
explain. Run under ``ddp-hpc run`` (which switches torch's flight recorder on):

    SKIP_RANK=1 SKIP_STEP=3 WATCHDOG_S=6 ddp-hpc run -- python skip_collective_loop.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ddp_hpc

STEPS = 6


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    skip_rank, skip_step = int(os.environ["SKIP_RANK"]), int(os.environ["SKIP_STEP"])
    grads = torch.ones(1024)  # 4 kB
    with ddp_hpc.watchdog(float(os.environ["WATCHDOG_S"])) as dog:
        for step in range(STEPS):
            if (rank, step) == (skip_rank, skip_step):
                marker = os.environ.get("SKIP_MARKER")
                if marker:
                    with open(marker, "w") as handle:
                        handle.write(str(time.time()))
            else:
                dist.all_reduce(grads)
            dog.beat(step=step + 1)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

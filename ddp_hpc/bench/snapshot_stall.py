"""The in-memory snapshot tier beside the disk formats in ``ddp-hpc bench checkpoints``.

On each rank of the same launch as the disk formats: a model of the same weights, sharded by
FSDP2 (``fully_shard``), with Adam's state, snapshotted by the one in-job recovery uses
(``engine/recovery/shards.Snapshots``: ``take`` copies the rank's shards into host buffers
kept between snapshots, a thread serializes the copy and writes it to node-local memory).
Per snapshot: the *stall* (how long ``take`` kept the loop waiting, measured by the caller)
and the *background* part (until the thread is done); and, measured in the same run, one
copy of the same local shards into host buffers (``device_clock.host_copy_baseline``:
pinned from a GPU, host-to-host on CPU ranks), the median stall as a multiple of its median
(a take varies by 2x on a loaded machine; one take against the copy says little). The copies
are not swapped with buddies here (a background part over the network; no buddy is
needed for the stall), so node-local memory holds two steps of each rank's own copy.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ddp_hpc.bench.device_clock import host_copy_baseline, synchronize

#: Issue 38: a snapshot should hold the loop at most this many times one copy to host memory.
SNAPSHOT_STALL_TARGET = 1.2


def measure_snapshot_stall(ctx: Any, megabytes: int, takes: int, folder: Path) -> dict[str, Any]:
    """Take ``takes`` snapshots of a sharded model of ``megabytes`` of weights on this rank
    (every rank of ``ctx``'s group calls it); this rank's figures."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddp_hpc.engine.recovery.shards import Buddies, SnapshotFiles, Snapshots, localized, snapshot_root

    layers = 8
    width = int(math.sqrt(megabytes * 1e6 / 4 / layers))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(ctx.torch_device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width, device=ctx.torch_device)).sum().backward()
    optimizer.step()  # Adam's moments exist: they are part of each snapshot
    optimizer.zero_grad(set_to_none=True)
    step = 0

    def state() -> dict[str, Any]:
        return {"step": step, "objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}}

    local, _ = localized(state())
    shards = [t for t in _tensors(local) if t.numel()]
    baseline = host_copy_baseline(shards)
    # Not attached to a group: no swap, and the copy is slot 0's, in a folder of this rank's own.
    files = SnapshotFiles(snapshot_root(folder / f"rank-{ctx.rank}", os.environ))
    snapshots = Snapshots(1, Buddies(world_size=ctx.world_size, distance=1), files, state)
    stall, background = [], []
    try:
        for _ in range(takes + 1):  # the first take allocates the host buffers: not counted
            step += 1
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.to_local().add_(1e-3)  # a new state each time
            synchronize(ctx.torch_device)
            started = time.perf_counter()
            snapshots.take(step)
            taken = time.perf_counter()
            snapshots.wait()
            if step > 1:
                stall.append(taken - started)
                background.append(time.perf_counter() - taken)
    finally:
        snapshots.wait()
        files.remove([0])
    return {"stall_s": stall, "background_s": background, "internal_stall_s": snapshots.last_stall_s,
            "snapshot_bytes": snapshots.last_bytes, "copy_baseline": baseline,
            "stall_over_copy": statistics.median(stall) / baseline["copy_median_s"]}


def _tensors(tree: Any) -> list[Any]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in _tensors(value)]
    return []

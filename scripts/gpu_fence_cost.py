"""What NCCL in-job recovery costs a step on one GPU (gpu-checks item 4), one JSON line.

    python scripts/gpu_fence_cost.py [--device cuda] [--steps 40] [--pairs 6] [--hidden 4096]

1. The step fence (``engine/recovery/fence.py``): the same DDP loop over a one-rank NCCL group,
   blocks of ``--steps`` steps with and without the ``StepFence`` on its optimizer, alternating,
   ``--pairs`` pairs; every pair's mean step time is printed, then the mean of the differences.
   The fence waits for the step's stream before the optimizer step: its cost is the host's
   lost lead on the GPU, largest for a model whose steps are short.
2. ``ProcessGroup.abort`` of a one-rank NCCL group that has run an all-reduce (three groups,
   each timed). A real abort cuts a kernel waiting on a lost peer short; one rank cannot show
   that, so this is the abort's own cost on an idle communicator.
``--device cpu`` (gloo, no fence wait) is the dry run of the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_hpc.engine.recovery.fence import StepFence, wait_for_stream  # noqa: E402
from ddp_hpc.engine.recovery.group_abort import abort_group  # noqa: E402


def timed_block(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, steps: int,
                device: torch.device) -> float:
    """Mean seconds per step over ``steps`` steps, the device drained before and after."""
    wait_for_stream(device.type)
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()
    wait_for_stream(device.type)
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    store_dir = tempfile.mkdtemp(prefix="fence-cost-")
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    kwargs = {"device_id": device} if cuda else {}
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers).to(device),
                                                device_ids=[0] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, args.hidden, device=device)
    fence = StepFence(device.type, timeout_s=600.0)
    timed_block(model, optimizer, batch, 10, device)  # warm-up: allocations, cuBLAS plans, the reducer's buckets
    pairs = []
    for index in range(args.pairs):
        order = (False, True) if index % 2 == 0 else (True, False)
        times = {}
        for fenced in order:
            handle = fence.attach(optimizer) if fenced else None
            times[fenced] = timed_block(model, optimizer, batch, args.steps, device)
            fence.step_ended()
            if handle is not None:
                handle.remove()
        pairs.append({"first": "fenced" if order[0] else "plain", "plain_ms": round(times[False] * 1e3, 3),
                      "fenced_ms": round(times[True] * 1e3, 3)})
        print(f"pair {index}: plain {times[False] * 1e3:.3f} ms/step, fenced {times[True] * 1e3:.3f} ms/step "
              f"({pairs[-1]['first']} first)", file=sys.stderr, flush=True)
    differences = [pair["fenced_ms"] - pair["plain_ms"] for pair in pairs]
    aborts = []
    if cuda:
        for _ in range(3):
            group = dist.new_group([0], backend="nccl")
            probe = torch.ones(1024, device=device)
            dist.all_reduce(probe, group=group)
            torch.cuda.synchronize()
            started = time.perf_counter()
            abort_group(group, 0)
            aborts.append(round((time.perf_counter() - started) * 1e3, 2))
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "model": f"{args.layers} x Linear({args.hidden}) batch {args.batch}",
              "steps_per_block": args.steps, "pairs": pairs,
              "fence_cost_ms_mean": round(statistics.mean(differences), 3),
              "fence_cost_ms_stdev": round(statistics.stdev(differences), 3) if len(differences) > 1 else None,
              "plain_ms_mean": round(statistics.mean(p["plain_ms"] for p in pairs), 3),
              "abort_ms": aborts}
    print(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

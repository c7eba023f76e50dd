"""One benchmark process per rank (started by torchrun from ``ddp_hpc.bench.runner``).

Modes:
- ``trainer``: the ddp_hpc Trainer on the synthetic job, step times from a callback;
- ``handwritten``: the DDP loop every tutorial shows (DistributedSampler, DDP, SGD), timed
  the same way: the reference for the Trainer's overhead;
- ``bare``: init_process_group and one all_reduce: the reference for start-up time;
- ``allreduce``: all_reduce of a gradient-sized buffer, timed.
Rank 0 writes a JSON result to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

STARTED_AT_VAR = "DDP_HPC_BENCH_T0"


def _since_launch() -> float:
    return time.time() - float(os.environ[STARTED_AT_VAR])


def _write(out: str, result: dict) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(result))


def step_stats(stamps: list[float], warmup: int) -> dict:
    """Median and spread of the intervals between step ends, after ``warmup`` steps."""
    deltas = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    return {"median_step_s": statistics.median(deltas), "steps_timed": len(deltas),
            "p10_step_s": sorted(deltas)[len(deltas) // 10], "p90_step_s": sorted(deltas)[len(deltas) * 9 // 10]}


def run_trainer(args: argparse.Namespace) -> dict:
    import torch

    from ddp_hpc.config import load_config
    from ddp_hpc.distributed import DistributedOptions, process_group
    from ddp_hpc.training import Callback
    from ddp_hpc.training.job import create_job
    from ddp_hpc.training.run_folder import RunFolder
    from ddp_hpc.training.trainer import Trainer

    torch.set_num_threads(args.threads)

    class StepClock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.first_step_after_launch: float | None = None

        def on_step_end(self, trainer) -> None:
            self.stamps.append(time.perf_counter())
            if self.first_step_after_launch is None:
                self.first_step_after_launch = _since_launch()

    overrides = [
        "job.name=synthetic", f"job.params.samples={args.samples}", "job.params.val_samples=0",
        f"job.params.input_dim={args.input_dim}", f"job.params.hidden={args.hidden}", f"job.params.depth={args.depth}",
        f"training.batch_size={args.batch}", f"training.max_steps={args.steps}", "training.epochs=1000",
        "training.optimizer=sgd", "training.lr=0.01", "training.precision=fp32",
        "checkpoint.every_n_epochs=null", "checkpoint.resume=never", "logging.progress=never",
        f"logging.run_dir={args.run_dir}", "logging.name=bench",
        f"distributed.bucket_cap_mb={args.bucket_mb}", f"distributed.comm_hook={args.comm_hook}",
    ]
    config = load_config(None, overrides)
    clock = StepClock()
    with process_group(DistributedOptions(backend="gloo", device="cpu")) as ctx:
        job = create_job(config.job.name, config.job.params)
        Trainer(job, config, ctx, RunFolder(Path(args.run_dir) / f"bench-{os.getpid()}"), [clock]).fit()
        world = ctx.world_size
    stats = step_stats(clock.stamps, args.warmup)
    return {**stats, "world_size": world, "samples_per_s": args.batch * world / stats["median_step_s"],
            "first_step_after_launch_s": clock.first_step_after_launch}


def run_handwritten(args: argparse.Namespace) -> dict:
    """The minimal DDP loop of the PyTorch tutorials, on the same model and data."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_hpc.jobs.synthetic import SyntheticJob

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    job = SyntheticJob(samples=args.samples, val_samples=0, input_dim=args.input_dim, hidden=args.hidden,
                       depth=args.depth)
    model = DistributedDataParallel(job.build_model(), bucket_cap_mb=args.bucket_mb)
    dataset = job.build_datasets().train
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    stamps: list[float] = []
    first_step_after_launch = None
    epoch = 0
    while len(stamps) < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            stamps.append(time.perf_counter())
            if first_step_after_launch is None:
                first_step_after_launch = _since_launch()
            if len(stamps) == args.steps:
                break
        epoch += 1
    world = dist.get_world_size()
    del model
    dist.destroy_process_group()
    stats = step_stats(stamps, args.warmup)
    return {**stats, "world_size": world, "samples_per_s": args.batch * world / stats["median_step_s"],
            "first_step_after_launch_s": first_step_after_launch}


def run_bare(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    ready = _since_launch()
    dist.destroy_process_group()
    return {"first_all_reduce_after_launch_s": ready}


def run_allreduce(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    buffer = torch.ones(args.numel, dtype=torch.float16 if args.comm_hook == "fp16" else torch.float32)
    stamps = []
    for _ in range(args.steps):
        dist.all_reduce(buffer)
        stamps.append(time.perf_counter())
    world = dist.get_world_size()
    dist.destroy_process_group()
    stats = step_stats(stamps, args.warmup)
    return {**stats, "world_size": world, "bytes": buffer.numel() * buffer.element_size()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("trainer", "handwritten", "bare", "allreduce"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--input-dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--comm-hook", default="none")
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--run-dir", default="/tmp")
    args = parser.parse_args()
    runner = {"trainer": run_trainer, "handwritten": run_handwritten, "bare": run_bare,
              "allreduce": run_allreduce}[args.mode]
    _write(args.out, runner(args))
    # Leave before interpreter teardown (see ddp_hpc.cli.main): the result is written.
    os._exit(0)


if __name__ == "__main__":
    main()

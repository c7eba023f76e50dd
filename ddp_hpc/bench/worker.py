"""One benchmark process per rank (started by torchrun or mpiexec from ``ddp_hpc.bench.runner``).

Modes:
- ``loops``: ``trainer`` and ``handwritten`` below, alternating round by round in one launch;
- ``trainer``: the ddp_hpc Trainer on the synthetic job, at its configured cadences (the
  preemption agreement every 10 steps, the epoch-end metric reduction, a checkpoint at
  the end of every epoch);
- ``handwritten``: the DDP loop every tutorial shows (DistributedSampler, DDP, SGD), with
  what such a script does besides: the epoch loss all-reduced at the end of each epoch and
  rank 0 saving model and optimizer with ``torch.save`` once per epoch;
- ``stall``: the Trainer with a large state and ``checkpoint.every_n_steps``: how long
  rank 0 is blocked per checkpoint, synchronous or ``checkpoint.async``;
- ``device``: ``loops`` on the device the ranks get (``--device``), once per precision of
  ``--precisions`` (fp32, tf32, bf16): the figures MFU is computed from;
- ``bare``: init_process_group and one all_reduce, on the backend the Trainer gets for the
  same ``--device``: the reference for start-up time;
- ``allreduce``: all_reduce of a gradient-sized buffer, timed.

Every mode takes its device and backend from the project's own choice
(``ddp_hpc.device.select_device``, through ``process_group`` where the Trainer runs):
``--device cuda`` trains on ``cuda:LOCAL_RANK`` over nccl; the CPU plan passes ``cpu``.
On a GPU the step clock waits for the device at each epoch's end (``device_clock.synchronize``),
so queued kernels count in the epoch that queued them.

Step times are taken over whole epochs: from the end of the warm-up epochs (after their
checkpoint) to the end of the last epoch (after its checkpoint), divided by the steps in
between, so periodic work counts in full. Rank 0 writes a JSON result to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

from ddp_hpc.bench.device_clock import synchronize
from ddp_hpc.bench.peaks import MATMUL_PRECISION
from ddp_hpc.contract import BENCH_STARTED_AT_VAR, LAST_CHECKPOINT

#: Variables that carry rank and world size under each MPI (for ``bare`` under mpiexec).
MPI_RANK_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def _since_launch() -> float:
    return time.time() - float(os.environ[BENCH_STARTED_AT_VAR])


IMPORTED_AFTER_LAUNCH = None  # set by main() once the heavy imports are done
#: This process's CPU seconds (all threads) once torch is imported, set by main().
CPU_AT_IMPORT = 0.0


def _cpu_since_import() -> float:
    return time.process_time() - CPU_AT_IMPORT


def _write(out: str, result: dict, rank: int) -> None:
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def epoch_stats(stamps: list[float], epoch_ends: list[float], steps_per_epoch: int, warmup_epochs: int) -> dict:
    """Mean step time over whole epochs after the warm-up ones, plus the median step interval."""
    timed_epochs = len(epoch_ends) - warmup_epochs
    start = epoch_ends[warmup_epochs - 1] if warmup_epochs else stamps[0]
    steps = timed_epochs * steps_per_epoch - (0 if warmup_epochs else 1)
    deltas = [b - a for a, b in zip(stamps, stamps[1:])][warmup_epochs * steps_per_epoch:]
    return {"mean_step_s": (epoch_ends[-1] - start) / steps, "steps_timed": steps, "epochs_timed": timed_epochs,
            "median_step_s": statistics.median(deltas) if deltas else None,
            "max_step_s": max(deltas) if deltas else None}


def _synthetic_overrides(args: argparse.Namespace, precision: str = "fp32") -> list[str]:
    autocast = "bf16" if precision == "bf16" else "fp32"
    matmul = MATMUL_PRECISION[precision]
    return [
        "job.name=synthetic", f"job.params.samples={args.samples}", "job.params.val_samples=0",
        f"job.params.input_dim={args.input_dim}", f"job.params.hidden={args.hidden}", f"job.params.depth={args.depth}",
        f"training.batch_size={args.batch}", f"training.optimizer={args.optimizer}", "training.lr=0.01",
        f"training.precision={autocast}", f"training.matmul_precision={matmul}",
        "checkpoint.resume=never", "logging.progress=never",
        f"logging.run_dir={args.run_dir}", "logging.name=bench",
        f"distributed.bucket_cap_mb={args.bucket_mb}", f"distributed.comm_hook={args.comm_hook}",
    ]


def _trainer_fit(args: argparse.Namespace, ctx, phases: dict[str, float], tag: str,
                 overrides: list[str] = (), precision: str = "fp32") -> dict:
    """One Trainer fit in the process group ``ctx``; its step statistics."""
    from ddp_hpc.config import load_config
    from ddp_hpc.training import Callback
    from ddp_hpc.training.job import create_job
    from ddp_hpc.training.run_folder import RunFolder
    from ddp_hpc.training.trainer import Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.epoch_ends: list[float] = []

        def on_fit_start(self, trainer) -> None:
            phases.setdefault("trainer_ready", _since_launch())

        def on_step_end(self, trainer) -> None:
            self.stamps.append(time.perf_counter())
            if "first_step" not in phases:
                phases["first_step"] = _since_launch()
                phases["first_step_cpu_s"] = _cpu_since_import()

        def on_epoch_end(self, trainer, metrics) -> None:  # after the epoch's checkpoint
            synchronize(ctx.torch_device)
            self.epoch_ends.append(time.perf_counter())

    config = load_config(None, [*_synthetic_overrides(args, precision),
                                f"training.epochs={args.warmup_epochs + args.epochs + args.cooldown_epochs}",
                                f"checkpoint.every_n_epochs={args.checkpoint_every_epochs or 'null'}", *overrides])
    clock = Clock()
    job = create_job(config.job.name, config.job.params)
    trainer = Trainer(job, config, ctx, RunFolder(Path(args.run_dir) / f"bench-{os.getpid()}-{tag}"), [clock])
    trainer.fit()
    steps_per_epoch = trainer.steps_per_epoch
    del trainer
    return _loop_result(clock.stamps, clock.epoch_ends, steps_per_epoch, args, ctx.world_size)


def _loop_result(stamps: list[float], epoch_ends: list[float], steps_per_epoch: int, args: argparse.Namespace,
                 world: int) -> dict:
    if not args.epochs:
        return {"world_size": world, "steps_per_epoch": steps_per_epoch}
    timed = args.warmup_epochs + args.epochs  # the cool-down epochs after them are not timed
    stats = epoch_stats(stamps[:timed * steps_per_epoch], epoch_ends[:timed], steps_per_epoch, args.warmup_epochs)
    return {**stats, "world_size": world, "steps_per_epoch": steps_per_epoch,
            "samples_per_s": args.batch * world / stats["mean_step_s"]}


def _handwritten_fit(args: argparse.Namespace, phases: dict[str, float], tag: str, choice,
                     precision: str = "fp32") -> dict:
    """The minimal DDP loop of the PyTorch tutorials, on the same model and data, in the
    default process group (none for one process: it then trains without DDP, as the
    Trainer does, so both loops' scaling is measured against the same single-rank loop),
    on ``choice``'s device: batches copied from pinned memory on a GPU, bf16 autocast and
    float32 matmul precision as ``precision`` says (what the Trainer is configured with)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_hpc.builtin_jobs.synthetic import SyntheticJob

    grouped = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    device = choice.torch_device
    torch.set_float32_matmul_precision(MATMUL_PRECISION[precision])
    torch.manual_seed(0)
    job = SyntheticJob(samples=args.samples, val_samples=0, input_dim=args.input_dim, hidden=args.hidden,
                       depth=args.depth)
    model = job.build_model().to(device)
    ddp = (DistributedDataParallel(model, device_ids=choice.ddp_device_ids, bucket_cap_mb=args.bucket_mb)
           if world > 1 else model)
    dataset = job.build_datasets().train
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, pin_memory=device.type == "cuda")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    phases.setdefault("trainer_ready", _since_launch())
    stamps: list[float] = []
    epoch_ends: list[float] = []
    for epoch in range(args.warmup_epochs + args.epochs + args.cooldown_epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device=device)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad()
            with autocast:
                loss = loss_fn(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach().float() * len(targets)
            loss_sum[1] += len(targets)
            stamps.append(time.perf_counter())
            if "first_step" not in phases:
                phases["first_step"] = _since_launch()
                phases["first_step_cpu_s"] = _cpu_since_import()
        if grouped:
            dist.all_reduce(loss_sum)
        if rank == 0 and args.checkpoint_every_epochs and (epoch + 1) % args.checkpoint_every_epochs == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       Path(args.run_dir) / f"handwritten-{os.getpid()}-{tag}.pt")
        synchronize(device)
        epoch_ends.append(time.perf_counter())
    del ddp, model
    return _loop_result(stamps, epoch_ends, len(loader), args, world)


def _ddp_hpc_group(args: argparse.Namespace):
    """The Trainer's process group on the device and backend ddp_hpc chooses for ``--device``."""
    from ddp_hpc.startup.distributed import DistributedOptions, process_group

    return process_group(DistributedOptions(device=args.device))


def _device_choice(args: argparse.Namespace):
    """This rank's device and backend for ``--device``, for the modes that start their own group."""
    from ddp_hpc.device import select_device

    # Under mpiexec (the bare start-up baseline) there is no LOCAL_RANK: each MPI's own.
    local_rank = next((os.environ[name] for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                                     "PALS_LOCAL_RANKID") if os.environ.get(name)), "0")
    local_size = next((os.environ[name] for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                                     "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE") if os.environ.get(name)), "1")
    return select_device(args.device, local_rank=int(local_rank), local_world_size=int(local_size))


def run_trainer(args: argparse.Namespace) -> tuple[dict, int]:
    """One Trainer fit (the start-up figures)."""
    import torch

    torch.set_num_threads(args.threads)
    phases: dict[str, float] = {"imported": IMPORTED_AFTER_LAUNCH}
    with _ddp_hpc_group(args) as ctx:
        phases["group_ready"] = _since_launch()
        result = _trainer_fit(args, ctx, phases, "0")
        rank = ctx.rank
    return {**result, "phases_after_launch_s": phases, "first_step_after_launch_s": phases["first_step"]}, rank


def run_handwritten(args: argparse.Namespace) -> tuple[dict, int]:
    """One hand-written loop under torchrun, with its own init_process_group (start-up figures)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    phases: dict[str, float] = {"imported": IMPORTED_AFTER_LAUNCH}
    choice = _device_choice(args)
    choice.activate()
    dist.init_process_group(choice.backend)
    phases["group_ready"] = _since_launch()
    rank = dist.get_rank()
    result = _handwritten_fit(args, phases, "0", choice)
    dist.destroy_process_group()
    return {**result, "phases_after_launch_s": phases, "first_step_after_launch_s": phases["first_step"]}, rank


def run_loops(args: argparse.Namespace) -> tuple[dict, int]:
    """Trainer and hand-written loop alternating in one launch, ``--rounds`` pairs: both
    run at the same moment of the machine's load, in the same process."""
    import torch

    torch.set_num_threads(args.threads)
    loops = ["trainer", "handwritten", *(["trainer_async"] if args.with_async else [])]
    results: dict[str, list[dict]] = {mode: [] for mode in loops}
    order: list[str] = []
    with _ddp_hpc_group(args) as ctx:
        _alternate(args, ctx, loops, results, order, "fp32")
        rank = ctx.rank
    return {**results, "order": order}, rank


def _alternate(args: argparse.Namespace, ctx, loops: list[str], results: dict[str, list[dict]], order: list[str],
               precision: str) -> None:
    """``--rounds`` rounds of ``loops``, the order reversed every other round."""
    import gc

    for round_index in range(args.rounds):
        pair = loops if (round_index + args.first) % 2 == 0 else loops[::-1]
        for mode in pair:
            tag = f"{round_index}-{mode}-{precision}"
            if mode == "handwritten":
                result = _handwritten_fit(args, {}, tag, ctx.device, precision)
            else:
                result = _trainer_fit(args, ctx, {}, tag, ["checkpoint.async=true"] if mode == "trainer_async" else [],
                                      precision)
            gc.collect()
            results[mode].append(result)
            order.append(mode)


def run_device(args: argparse.Namespace) -> tuple[dict, int]:
    """``loops`` on the ranks' device once per precision of ``--precisions``, in one launch."""
    import torch

    torch.set_num_threads(args.threads)
    by_precision = {}
    with _ddp_hpc_group(args) as ctx:
        device = ctx.torch_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        for precision in args.precisions.split(","):
            results: dict[str, list[dict]] = {"trainer": [], "handwritten": []}
            order: list[str] = []
            _alternate(args, ctx, ["trainer", "handwritten"], results, order, precision)
            by_precision[precision] = {**results, "order": order}
        rank = ctx.rank
        where = {"device": str(device), "backend": ctx.backend, "device_name": name, "world_size": ctx.world_size}
    return {**where, "by_precision": by_precision}, rank


def run_stall(args: argparse.Namespace) -> tuple[dict, int]:
    """Time rank 0 is blocked in each checkpoint, and the background write times."""
    import torch

    from ddp_hpc.config import load_config
    from ddp_hpc.startup.distributed import DistributedOptions, process_group
    from ddp_hpc.training.job import create_job
    from ddp_hpc.training.run_folder import RunFolder
    from ddp_hpc.training.trainer import Trainer

    torch.set_num_threads(args.threads)
    blocked: list[dict] = []
    written: list[float] = []

    def timed(trainer: Trainer) -> None:
        """Record how long each save blocked training, and each write took."""
        checkpointer = trainer.state.checkpointer
        save = checkpointer.save

        def timed_save(*, wait: bool = False, best: bool = False):
            started = time.perf_counter()
            path = save(wait=wait, best=best)
            row = {"step": trainer.progress.global_step, "blocked_s": time.perf_counter() - started}
            writer = getattr(checkpointer.format, "writer", None)
            if writer is not None and ctx.is_rank_zero:
                timing = writer.last_submit
                row.update(waited_for_previous_s=timing.waited_s, snapshot_s=timing.snapshot_s)
            blocked.append(row)
            return path

        reported = checkpointer.on_written

        def on_written(record) -> None:
            written.append(record.write_s)
            reported(record)

        checkpointer.save, checkpointer.on_written = timed_save, on_written

    config = load_config(None, [*_synthetic_overrides(args), "training.epochs=1",
                                f"training.max_steps={args.checkpoints * args.every + args.every // 2}",
                                "checkpoint.every_n_epochs=null", f"checkpoint.every_n_steps={args.every}",
                                f"checkpoint.async={'true' if args.async_checkpoint else 'false'}"])
    with process_group(DistributedOptions(device=args.device)) as ctx:
        job = create_job(config.job.name, config.job.params)
        trainer = Trainer(job, config, ctx, RunFolder(Path(args.run_dir) / f"stall-{os.getpid()}"))
        timed(trainer)
        trainer.fit()
        rank = ctx.rank
        state_bytes = 0
        if rank == 0:
            path = trainer.run.checkpoints / LAST_CHECKPOINT
            state_bytes = path.stat().st_size
    periodic = [b for b in blocked if b["step"] % args.every == 0]
    return {"async": args.async_checkpoint, "checkpoint_bytes": state_bytes, "blocked": periodic,
            "blocked_s": [b["blocked_s"] for b in periodic],
            "write_s": written if args.async_checkpoint else [b["blocked_s"] for b in periodic]}, rank


def _mpi_rank() -> tuple[int, int] | None:
    for rank_var, size_var in MPI_RANK_VARS:
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return None


def run_bare(args: argparse.Namespace) -> tuple[dict, int]:
    import torch
    import torch.distributed as dist

    phases: dict[str, float] = {"imported": IMPORTED_AFTER_LAUNCH}
    # The baseline on the backend the Trainer gets for the same --device (nccl on a GPU), not gloo always.
    choice = _device_choice(args)
    choice.activate()
    mpi = _mpi_rank()
    if mpi is None:  # torchrun: env://
        dist.init_process_group(choice.backend)
    else:
        dist.init_process_group(choice.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=mpi[0],
                                world_size=mpi[1])
    phases["group_ready"] = _since_launch()
    dist.all_reduce(torch.ones(1, device=choice.torch_device))
    phases["first_step"] = _since_launch()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"phases_after_launch_s": phases, "first_step_after_launch_s": phases["first_step"]}, rank


def run_allreduce(args: argparse.Namespace) -> tuple[dict, int]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    choice = _device_choice(args)
    choice.activate()
    dist.init_process_group(choice.backend)
    # One launch times every hook given (``--comm-hook none,fp16``), one after the other.
    by_hook = {}
    for hook in args.comm_hook.split(","):
        buffer = torch.ones(args.numel, dtype=torch.float16 if hook == "fp16" else torch.float32,
                            device=choice.torch_device)
        stamps = []
        for _ in range(args.steps):
            dist.all_reduce(buffer)
            synchronize(choice.torch_device)
            stamps.append(time.perf_counter())
        deltas = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup_steps:]
        by_hook[hook] = {"mean_step_s": statistics.fmean(deltas), "median_step_s": statistics.median(deltas),
                         "bytes": buffer.numel() * buffer.element_size()}
    world, rank = dist.get_world_size(), dist.get_rank()
    dist.destroy_process_group()
    return {"world_size": world, "by_hook": by_hook}, rank


def main() -> None:
    global IMPORTED_AFTER_LAUNCH, CPU_AT_IMPORT
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("loops", "device", "trainer", "handwritten", "stall", "bare", "allreduce"))
    parser.add_argument("--device", default="cpu", help="cpu, cuda, xpu or auto: ddp_hpc's device choice")
    parser.add_argument("--precisions", default="fp32,bf16", help="device mode: fp32, tf32, bf16, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="loops mode: Trainer/hand-written pairs")
    parser.add_argument("--with-async", action="store_true",
                        help="loops mode: also the Trainer with checkpoint.async (trainer_async)")
    parser.add_argument("--first", type=int, default=0, help="loops mode: 1 starts with the hand-written loop")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs")
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--cooldown-epochs", type=int, default=0,
                        help="untimed epochs after the timed ones (the Trainer's save at the end of training falls there)")
    parser.add_argument("--checkpoint-every-epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40, help="allreduce mode")
    parser.add_argument("--warmup-steps", type=int, default=3, help="allreduce mode")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--input-dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--comm-hook", default="none", help="allreduce mode: several, comma-separated")
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--every", type=int, default=10, help="stall mode: checkpoint every N steps")
    parser.add_argument("--checkpoints", type=int, default=3, help="stall mode: periodic checkpoints")
    parser.add_argument("--async", dest="async_checkpoint", action="store_true", help="stall mode")
    parser.add_argument("--port", type=int, default=29500, help="bare mode under mpiexec")
    parser.add_argument("--run-dir", default="/tmp")
    args = parser.parse_args()
    import torch  # noqa: F401  (the import every mode pays, timed as "imported")

    IMPORTED_AFTER_LAUNCH = _since_launch()
    CPU_AT_IMPORT = time.process_time()
    runner = {"loops": run_loops, "device": run_device, "trainer": run_trainer, "handwritten": run_handwritten, "stall": run_stall, "bare": run_bare,
              "allreduce": run_allreduce}[args.mode]
    result, rank = runner(args)
    _write(args.out, result, rank)
    # Leave before interpreter teardown (see ddp_hpc.cli.main): the result is written.
    os._exit(0)


if __name__ == "__main__":
    main()

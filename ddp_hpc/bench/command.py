"""``ddp-hpc bench MODE``'s runs (``verb.py`` registers the modes and their flags). The heavy
modules load only for the mode asked for."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ddp_hpc.bench.results_file import check_output
from ddp_hpc.errors import UserError


def _plot(args: argparse.Namespace) -> Path | None:
    return Path(args.plot) if args.plot else None


def _loops(args: argparse.Namespace) -> None:
    from ddp_hpc.bench.runner import parse_sizes, run_bench

    run_bench(args.quick, Path(args.output), _plot(args),
              startup_sizes=parse_sizes(args.startup_sizes) if args.startup_sizes else None)


def _mfu(args: argparse.Namespace) -> None:
    from ddp_hpc.bench.device_run import run_device_bench

    if args.mfu_ranks < 1:
        raise UserError(f"bench mfu --ranks {args.mfu_ranks}: give at least 1")
    run_device_bench(Path(args.output), args.device, args.mfu_ranks, args.quick)


def _checkpoints(args: argparse.Namespace) -> None:
    from ddp_hpc.bench.checkpoint_formats import run_checkpoint_formats
    from ddp_hpc.bench.runner import parse_sizes

    if args.checkpoint_saves < 1:
        raise UserError(f"bench checkpoints --saves {args.checkpoint_saves}: give at least 1")
    output = Path(args.output)
    run_checkpoint_formats(parse_sizes(args.checkpoint_sizes, flag="bench checkpoints --sizes", smallest=1),
                           args.checkpoint_mb, output, output.parent / "checkpoint-formats",
                           saves=args.checkpoint_saves, device=args.device)


def _goodput(args: argparse.Namespace) -> None:
    from ddp_hpc.bench.goodput_run import GoodputPlan, run_goodput

    plan = GoodputPlan(arms=tuple(args.goodput_arms.split(",")), duration_s=args.goodput_minutes * 60,
                       interval_s=args.goodput_interval, world_size=args.goodput_ranks, fault=args.goodput_fault,
                       seed=args.goodput_seed, rounds=args.goodput_rounds,
                       checkpoint_every=args.goodput_checkpoint_every, hang_timeout_s=args.goodput_hang_timeout,
                       step_work_s=args.goodput_step_work)
    output = Path(args.output)
    run_goodput(plan, output, output.parent / "goodput", _plot(args))


def _scale(args: argparse.Namespace) -> None:
    from ddp_hpc.bench.runner import parse_sizes
    from ddp_hpc.bench.scale import run_scale

    check = parse_sizes(args.scale_check, flag="bench scale --check") if args.scale_check else ()
    if len(check) > 1:
        raise UserError(f"bench scale --check {args.scale_check!r}: one world size (e.g. 32), or '' for none")
    run_scale(parse_sizes(args.scale, flag="bench scale"), Path(args.output), check_size=check[0] if check else None)


def _own_cpu(args: argparse.Namespace) -> None:
    from ddp_hpc.bench.runner import run_own_cpu

    run_own_cpu(Path(args.output))


RUNS: dict[str, Callable[[argparse.Namespace], None]] = {
    "loops": _loops, "mfu": _mfu, "checkpoints": _checkpoints, "goodput": _goodput, "scale": _scale,
    "own-cpu": _own_cpu}

#: The modes that run on a chosen device; the others measure CPU ranks.
ON_A_DEVICE = ("mfu", "checkpoints")


def bench(args: argparse.Namespace, mode: str) -> int:
    """``ddp-hpc bench MODE``: the figures of one mode (see ``ddp-hpc bench MODE --help``)."""
    # Before the heavy imports: a refused output answers at once, not after minutes of work.
    check_output(Path(args.output))
    if args.device != "auto" and mode not in ON_A_DEVICE:
        raise UserError(f"--device {args.device}: only bench mfu and bench checkpoints run on a chosen device; "
                        f"bench {mode} measures CPU ranks")
    if args.plot and mode not in ("loops", "goodput"):
        raise UserError(f"--plot: bench {mode} draws no figure (bench loops and bench goodput do)")
    RUNS[mode](args)
    return 0

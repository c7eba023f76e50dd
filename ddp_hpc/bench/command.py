"""``ddp-hpc bench``'s dispatch: which benchmark the parsed flags ask for. The CLI parses and
calls ``bench``; the heavy modules load only for the figures asked for."""

from __future__ import annotations

import argparse
from pathlib import Path

from ddp_hpc.bench.results_file import check_output
from ddp_hpc.errors import UserError


def bench(args: argparse.Namespace) -> int:
    """``ddp-hpc bench``: the figures its flags ask for (see ``ddp-hpc bench --help``)."""
    # Before the heavy imports: a refused output answers at once, not after minutes of work.
    check_output(Path(args.output))
    from ddp_hpc.bench.runner import parse_sizes, run_bench

    if args.device != "auto" and not (args.checkpoints or args.mfu):
        raise UserError(f"--device {args.device}: only --mfu and --checkpoints run on a chosen device; "
                        "the other figures measure CPU ranks")
    if args.checkpoints:
        from ddp_hpc.bench.checkpoint_formats import run_checkpoint_formats

        if args.checkpoint_saves < 1:
            raise UserError(f"--checkpoint-saves {args.checkpoint_saves}: give at least 1")
        output = Path(args.output)
        run_checkpoint_formats(parse_sizes(args.checkpoint_sizes, flag="--checkpoint-sizes", smallest=1),
                               args.checkpoint_mb, output, output.parent / "checkpoint-formats",
                               saves=args.checkpoint_saves, device=args.device)
        return 0
    if args.mfu:
        from ddp_hpc.bench.device_run import run_device_bench

        if args.mfu_ranks < 1:
            raise UserError(f"--mfu-ranks {args.mfu_ranks}: give at least 1")
        run_device_bench(Path(args.output), args.device, args.mfu_ranks, args.quick)
        return 0
    if args.goodput:
        from ddp_hpc.bench.goodput_run import GoodputPlan, run_goodput

        plan = GoodputPlan(arms=tuple(args.goodput_arms.split(",")), duration_s=args.goodput_minutes * 60,
                           interval_s=args.goodput_interval, world_size=args.goodput_ranks, fault=args.goodput_fault,
                           seed=args.goodput_seed, rounds=args.goodput_rounds,
                           checkpoint_every=args.goodput_checkpoint_every, hang_timeout_s=args.goodput_hang_timeout,
                           step_work_s=args.goodput_step_work)
        output = Path(args.output)
        run_goodput(plan, output, output.parent / "goodput")
        return 0
    if args.own_cpu:
        from ddp_hpc.bench.runner import run_own_cpu

        run_own_cpu(Path(args.output))
        return 0
    if args.scale:
        from ddp_hpc.bench.scale import run_scale

        check = parse_sizes(args.scale_check, flag="--scale-check") if args.scale_check else ()
        if len(check) > 1:
            raise UserError(f"--scale-check {args.scale_check!r}: one world size (e.g. 32), or '' for none")
        run_scale(parse_sizes(args.scale, flag="--scale"), Path(args.output), check_size=check[0] if check else None)
        return 0
    run_bench(args.quick, Path(args.output), Path(args.plot) if args.plot else None,
              startup_sizes=parse_sizes(args.startup_sizes) if args.startup_sizes else None)
    return 0

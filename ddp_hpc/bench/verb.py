"""``ddp-hpc bench``: its parser (the CLI adds it, ``cli.py``); the run is ``command.py``'s."""

from __future__ import annotations

import argparse
from typing import Any

from ddp_hpc.cli_args import positive_float


def _cmd_bench(args: argparse.Namespace) -> int:
    from ddp_hpc.bench.command import bench

    return bench(args)


def add_bench_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    bench = sub.add_parser("bench", parents=[common],
                           help="benchmark the Trainer against a hand-written DDP loop and ideal scaling")
    bench.add_argument("--quick", action="store_true",
                       help="a small plan for smoke tests (2 rounds, start-up at 2 and 4 ranks)")
    bench.add_argument("--startup-sizes", metavar="N,N,...",
                       help="world sizes of the start-up figures (default: 2,4,8,16; --quick: 2,4)")
    bench.add_argument("--scale", metavar="N,N,...",
                       help="instead: N simulated ranks against one real rendezvous store (handshake, gate, "
                            "heartbeat, diagnosis, bytes at rank 0), e.g. 256,1024,4096; merged into --output")
    bench.add_argument("--scale-check", metavar="N", default="32",
                       help="with --scale: also N ranks as separate processes vs threads ('' for none)")
    bench.add_argument("--own-cpu", action="store_true",
                       help="instead: ddp_hpc's own CPU per rank before the first step at 2 ranks (Trainer minus "
                            "a hand-written loop); merged into --output")
    bench.add_argument("--checkpoints", action="store_true",
                       help="instead: checkpoint stall and write time, file vs dcp, sync vs background, next to the "
                            "disk's sequential write bandwidth; merged into --output")
    bench.add_argument("--checkpoint-sizes", metavar="N,N,...", default="2,4",
                       help="with --checkpoints: world sizes (default: 2,4)")
    bench.add_argument("--checkpoint-mb", type=int, default=400, metavar="MB",
                       help="with --checkpoints: the model's weights in MB (default: 400)")
    bench.add_argument("--checkpoint-saves", type=int, default=2, metavar="N",
                       help="with --checkpoints: saves per format and mode (default: 2)")
    bench.add_argument("--mfu", action="store_true",
                       help="instead: the Trainer vs a hand-written loop on the ranks' device (--device), in fp32, "
                            "TF32 and bf16, with MFU where the card's peak is known; --quick: a tiny model; merged "
                            "into --output")
    bench.add_argument("--mfu-ranks", type=int, default=1, metavar="N",
                       help="with --mfu: ranks, one device each (default: 1)")
    bench.add_argument("--device", default="auto", choices=("auto", "cuda", "xpu", "cpu"),
                       help="with --mfu and --checkpoints: the ranks' device, chosen as ddp-hpc train chooses it "
                            "(default: auto: cuda:LOCAL_RANK with nccl on a CUDA host); the main plan measures "
                            "CPU ranks")
    bench.add_argument("--goodput", action="store_true",
                       help="instead: the same loop under in-job recovery, restart in place and requeue, with a "
                            "rank killed (or frozen) at a fixed rate: goodput and each failure's cost; merged into "
                            "--output, the ranks' logs beside it in goodput/")
    bench.add_argument("--goodput-minutes", type=positive_float, default=5.0, metavar="M",
                       help="with --goodput: minutes each arm runs, per round (default: 5)")
    bench.add_argument("--goodput-interval", type=positive_float, default=30.0, metavar="S",
                       help="with --goodput: seconds between faults (default: 30)")
    bench.add_argument("--goodput-ranks", type=int, default=4, metavar="N",
                       help="with --goodput: world size (default: 4)")
    bench.add_argument("--goodput-fault", choices=("kill", "hang", "mixed"), default="kill",
                       help="with --goodput: SIGKILL of a rank, SIGSTOP (a hung rank, found by the hang timeout), "
                            "or either, drawn per fault (default: kill)")
    bench.add_argument("--goodput-step-work", type=float, default=0.0, metavar="S",
                       help="with --goodput: seconds of the loop's own work after each optimizer step, before "
                            "step_done, so that faults land there too (default: 0)")
    bench.add_argument("--goodput-hang-timeout", type=positive_float, default=5.0, metavar="S",
                       help="with --goodput: seconds of silence that make a rank hung (--hang-timeout of the "
                            "in-job arm, the watchdog's limit in the others; default: 5)")
    bench.add_argument("--goodput-arms", default="in-job,in-job-spare,restart,requeue", metavar="ARM,...",
                       help="with --goodput: which arms, in this order each round (default: "
                            "in-job,in-job-spare,restart,requeue; fsdp2-in-job,fsdp2-in-job-spare,fsdp2-restart: the model "
                            "sharded)")
    bench.add_argument("--goodput-rounds", type=int, default=1, metavar="R",
                       help="with --goodput: rounds of the arms, alternating (default: 1)")
    bench.add_argument("--goodput-seed", type=int, default=0, metavar="N",
                       help="with --goodput: seed of the fault schedule (which rank, which fault), the same in every arm")
    bench.add_argument("--goodput-checkpoint-every", type=int, default=50, metavar="N",
                       help="with --goodput: steps between checkpoints, in every arm (default: 50)")
    bench.add_argument("--output", default="benchmarks/results/bench.json", help="JSON results file")
    bench.add_argument("--plot", default="benchmarks/results/scaling.png", help="PNG plot ('' for none)")
    bench.set_defaults(func=_cmd_bench)

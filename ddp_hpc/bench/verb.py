"""``ddp-hpc bench MODE``: one subcommand per benchmark, each registered here with its own
flags (the CLI adds the verb, ``cli.py``); what each runs is ``command.py``'s.

``ddp-hpc bench`` alone is ``bench loops`` (the Trainer against a hand-written loop: overhead,
scaling, checkpoint stall, start-up). The old spellings (``bench --mfu``, ``--goodput-minutes``,
...) still work, each with one line naming the new one: they set the same values.
"""

from __future__ import annotations

import argparse
import copy
import logging
from dataclasses import dataclass
from typing import Any

from ddp_hpc.cli_args import positive_float
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_OUTPUT = "benchmarks/results/bench.json"
DEVICES = ("auto", "cuda", "xpu", "cpu")


@dataclass(frozen=True)
class Flag:
    """One flag of a mode: its spelling under ``bench MODE`` and, where it had one, the old
    spelling on ``bench`` itself; both set ``dest``."""

    new: str
    old: str | None
    dest: str
    options: dict[str, Any]


@dataclass(frozen=True)
class BenchMode:
    name: str
    help: str
    #: The old flag that chose this mode on ``bench`` itself (``--mfu``); None for the default.
    old_switch: str | None
    flags: tuple[Flag, ...]
    #: Whether it draws a figure (``--plot FILE``; '' for none) and where by default.
    plot: str | None = None
    #: A positional argument (``bench scale 256,1024``): (dest, metavar, help).
    positional: tuple[str, str, str] | None = None


def _device_flag(modes: str) -> Flag:
    return Flag("--device", "--device", "device",
                dict(default="auto", choices=DEVICES,
                     help=f"the ranks' device, chosen as ddp-hpc train chooses it (default: auto: cuda:LOCAL_RANK with "
                          f"nccl on a CUDA host); {modes}"))


MODES: tuple[BenchMode, ...] = (
    BenchMode("loops", "the Trainer against a hand-written DDP loop: overhead, scaling, checkpoint stall, start-up "
                       "(the default)", None, (
        Flag("--quick", "--quick", "quick",
             dict(action="store_true", help="a small plan for smoke tests (2 rounds, start-up at 2 and 4 ranks)")),
        Flag("--startup-sizes", "--startup-sizes", "startup_sizes",
             dict(metavar="N,N,...", help="world sizes of the start-up figures (default: 2,4,8,16; --quick: 2,4)")),
    ), plot="benchmarks/results/scaling.png"),
    BenchMode("mfu", "the Trainer against a hand-written loop on the ranks' device in fp32, TF32 and bf16, with MFU "
                     "where the card's peak is known", "--mfu", (
        Flag("--quick", "--quick", "quick", dict(action="store_true", help="a tiny model")),
        Flag("--ranks", "--mfu-ranks", "mfu_ranks", dict(type=int, default=1, metavar="N",
                                                         help="ranks, one device each (default: 1)")),
        _device_flag("the main plan measures CPU ranks"),
    )),
    BenchMode("checkpoints", "checkpoint stall and write time, file against dcp, sync against background, next to "
                             "the disk's sequential write bandwidth", "--checkpoints", (
        Flag("--sizes", "--checkpoint-sizes", "checkpoint_sizes",
             dict(metavar="N,N,...", default="2,4", help="world sizes (default: 2,4)")),
        Flag("--mb", "--checkpoint-mb", "checkpoint_mb",
             dict(type=int, default=400, metavar="MB", help="the model's weights in MB (default: 400)")),
        Flag("--saves", "--checkpoint-saves", "checkpoint_saves",
             dict(type=int, default=2, metavar="N", help="saves per format and mode (default: 2)")),
        _device_flag("the main plan measures CPU ranks"),
    )),
    BenchMode("goodput", "the same loop under in-job recovery, restart in place and requeue, with a rank killed "
                         "(or frozen) at a fixed rate: goodput and each failure's cost; the ranks' logs beside the "
                         "output in goodput/", "--goodput", (
        Flag("--minutes", "--goodput-minutes", "goodput_minutes",
             dict(type=positive_float, default=5.0, metavar="M", help="minutes each arm runs, per round (default: 5)")),
        Flag("--interval", "--goodput-interval", "goodput_interval",
             dict(type=positive_float, default=30.0, metavar="S", help="seconds between faults (default: 30)")),
        Flag("--ranks", "--goodput-ranks", "goodput_ranks",
             dict(type=int, default=4, metavar="N", help="world size (default: 4)")),
        Flag("--fault", "--goodput-fault", "goodput_fault",
             dict(choices=("kill", "hang", "mixed"), default="kill",
                  help="SIGKILL of a rank, SIGSTOP (a hung rank, found by the hang timeout), or either, drawn per "
                       "fault (default: kill)")),
        Flag("--step-work", "--goodput-step-work", "goodput_step_work",
             dict(type=float, default=0.0, metavar="S",
                  help="seconds of the loop's own work after each optimizer step, before step_done, so that faults "
                       "land there too (default: 0)")),
        Flag("--hang-timeout", "--goodput-hang-timeout", "goodput_hang_timeout",
             dict(type=positive_float, default=5.0, metavar="S",
                  help="seconds of silence that make a rank hung (--hang-timeout of the in-job arm, the watchdog's "
                       "limit in the others; default: 5)")),
        Flag("--arms", "--goodput-arms", "goodput_arms",
             dict(default="in-job,in-job-spare,restart,requeue", metavar="ARM,...",
                  help="which arms, in this order each round (default: in-job,in-job-spare,restart,requeue; "
                       "fsdp2-in-job,fsdp2-in-job-spare,fsdp2-restart: the model sharded)")),
        Flag("--rounds", "--goodput-rounds", "goodput_rounds",
             dict(type=int, default=1, metavar="R", help="rounds of the arms, alternating (default: 1)")),
        Flag("--seed", "--goodput-seed", "goodput_seed",
             dict(type=int, default=0, metavar="N",
                  help="seed of the fault schedule (which rank, which fault), the same in every arm")),
        Flag("--checkpoint-every", "--goodput-checkpoint-every", "goodput_checkpoint_every",
             dict(type=int, default=50, metavar="N", help="steps between checkpoints, in every arm (default: 50)")),
    ), plot="benchmarks/results/goodput.png"),
    BenchMode("scale", "N simulated ranks against one real rendezvous store (handshake, gate, heartbeat, diagnosis, "
                       "bytes at rank 0)", "--scale", (
        Flag("--check", "--scale-check", "scale_check",
             dict(metavar="N", default="32", help="also N ranks as separate processes against threads ('' for none)")),
    ), positional=("scale", "N,N,...", "simulated world sizes, e.g. 256,1024,4096")),
    BenchMode("own-cpu", "ddp_hpc's own CPU per rank before the first step at 2 ranks (the Trainer minus a "
                         "hand-written loop)", "--own-cpu", ()),
)

#: The old switches: ``--scale`` took the sizes, the others were on/off.
def _old_dest(mode: BenchMode) -> str:
    """Where the old switch that chose ``mode`` on ``bench`` itself (``--mfu``) puts its value."""
    return f"old_{mode.name.replace('-', '_')}"


def _cmd_bench(args: argparse.Namespace) -> int:
    from ddp_hpc.bench.command import bench

    chosen = [mode for mode in MODES if mode.old_switch and getattr(args, _old_dest(mode), None)]
    given = " and ".join(str(mode.old_switch) for mode in chosen)
    if args.bench_mode is not None and chosen:
        raise UserError(f"bench {args.bench_mode}: {given} choose(s) another benchmark: "
                        f"give the mode alone (bench {args.bench_mode} ...)")
    if args.bench_mode is None and chosen:
        mode = chosen[0]
        if len(chosen) > 1:
            raise UserError(f"bench: {given} each choose a benchmark: give one (bench {mode.name} ...)")
        if mode.positional:  # --scale took the sizes
            setattr(args, mode.positional[0], getattr(args, _old_dest(mode)))
        log.warning("ddp-hpc bench %s is now ddp-hpc bench %s (the same figures; the old spelling still works)",
                    mode.old_switch, mode.name)
        args.bench_mode = mode.name
    mode = args.bench_mode or "loops"
    if args.plot is None:  # the mode's own figure, where it draws one
        args.plot = mode_named(mode).plot or ""
    return bench(args, mode)


def _add_flags(parser: argparse.ArgumentParser, mode: BenchMode, *, old: bool) -> None:
    taken = {option for action in parser._actions for option in action.option_strings}
    for flag in mode.flags:
        spelling = flag.old if old else flag.new
        if spelling is None or spelling in taken:  # --quick and --device: one old flag for the modes that share it
            continue
        options = {**flag.options, "help": argparse.SUPPRESS} if old else flag.options
        parser.add_argument(spelling, dest=flag.dest, **options)


def _own_copies(parser: argparse.ArgumentParser, *shared: argparse.ArgumentParser) -> None:
    """The shared flags (``--debug``, ``--output``) on a mode's parser as copies of their own:
    argparse's ``parents`` shares the action objects, and ``_values_from_bench`` changes them."""
    for source in shared:
        for action in source._actions:
            if action.option_strings and action.dest != "help":
                parser._add_action(copy.copy(action))


def _values_from_bench(parser: argparse.ArgumentParser) -> None:
    """A mode's flags set only what they are given: every default is ``bench``'s own (one
    default per value, and ``bench --output F mfu`` keeps F: argparse copies a subcommand's
    whole namespace, defaults too, over its parent's)."""
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            action.default = argparse.SUPPRESS


def add_bench_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--output", default=DEFAULT_OUTPUT, help=f"JSON results file (default: {DEFAULT_OUTPUT}); "
                                                                  "each benchmark merges its figures into it")
    # No abbreviations: `bench` reads every word first, and `scale --check` would be an
    # abbreviation of its hidden --checkpoint-sizes.
    bench = sub.add_parser("bench", parents=[common, output], allow_abbrev=False,
                           help="benchmarks: the Trainer against a hand-written loop, MFU, checkpoints, goodput "
                                "under faults, the rendezvous at scale (ddp-hpc bench MODE --help)",
                           description="ddp-hpc bench MODE (default: loops). "
                                       + "; ".join(f"{m.name}: {m.help}" for m in MODES) + ".")
    # The old spellings: every mode's flags on `bench` itself, hidden from --help; they hold the defaults.
    for mode in MODES:
        _add_flags(bench, mode, old=True)
    bench.add_argument("--plot", default=None, help=argparse.SUPPRESS)
    for mode in MODES:  # the old switches: --scale took the sizes, the others were on/off
        if mode.old_switch:
            taking = {"metavar": mode.positional[1]} if mode.positional else {"action": "store_true"}
            bench.add_argument(mode.old_switch, dest=_old_dest(mode), help=argparse.SUPPRESS, **taking)
    modes = bench.add_subparsers(dest="bench_mode", metavar="MODE", parser_class=type(bench))
    for mode in MODES:
        parser = modes.add_parser(mode.name, help=mode.help, description=mode.help, allow_abbrev=False)
        _own_copies(parser, common, output)
        if mode.positional:
            dest, metavar, text = mode.positional
            parser.add_argument(dest, metavar=metavar, help=text)
        _add_flags(parser, mode, old=False)
        if mode.plot is not None:
            parser.add_argument("--plot", help=f"PNG figure ('' for none; default: {mode.plot})")
        _values_from_bench(parser)
    bench.set_defaults(func=_cmd_bench)


def mode_named(name: str) -> BenchMode:
    return next(mode for mode in MODES if mode.name == name)

"""``ddp-hpc``: the command line. Each subcommand is a small function over typed values."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from ddp_hpc.contract import (
    BACKEND_VAR,
    DEBUG_VAR,
    DEVICE_VAR,
    ExitStatus,
)
from ddp_hpc.bench.verb import add_bench_parser
from ddp_hpc.cli_args import Parser, add_console_flag, add_device_flags, positive_float, write_line
from ddp_hpc.errors import UserError
from ddp_hpc.launch.verb import add_launch_parser
from ddp_hpc.logs import ConsoleFilter, configure_logging
from ddp_hpc.staging.verb import add_stage_parser
from ddp_hpc.version import __version__


def _cmd_env(args: argparse.Namespace) -> int:
    from ddp_hpc.device import backend_label, requested, select_device
    from ddp_hpc.environment import resolve_env

    dist_env = resolve_env(host_suffix=args.host_suffix)
    choice = select_device(requested(args.device, os.environ, DEVICE_VAR),
                           requested(args.backend, os.environ, BACKEND_VAR),
                           local_rank=dist_env.local_rank,
                           local_world_size=dist_env.local_world_size)
    report = {**dist_env.to_dict(), "host": socket.gethostname(),
              "device": str(choice.torch_device), "backend": choice.backend}
    if backend_label(choice.backend) != choice.backend:  # torch's ROCm build: nccl is RCCL
        report["backend_library"] = backend_label(choice.backend)
    if args.json:
        line = json.dumps(report, sort_keys=True)
    else:
        line = (f"rank {dist_env.rank}/{dist_env.world_size} local {dist_env.local_rank}/"
                f"{dist_env.local_world_size} node {dist_env.node_rank}/{dist_env.num_nodes} "
                f"source={dist_env.source} master={dist_env.master_addr}:{dist_env.master_port} "
                f"device={choice.torch_device} backend={backend_label(choice.backend)} host={report['host']}")
    write_line(sys.stdout, line)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ddp_hpc.startup.distributed import DistributedOptions, process_group
    from ddp_hpc.startup.doctor import run_doctor

    console = ConsoleFilter.from_environment(args.console_ranks, os.environ)
    options = DistributedOptions(device=args.device, backend=args.backend,
                                 timeout_s=args.timeout, host_suffix=args.host_suffix)
    with process_group(options) as ctx:
        configure_logging(ctx.rank, verbose=args.verbose, console=console)
        healthy, report = run_doctor(ctx)
        if ctx.is_rank_zero:
            print(report, flush=True)
        if args.links and healthy:
            from ddp_hpc.startup.links import format_links, measure_links

            hosts = ctx.all_gather_object(socket.gethostname())
            plan, verdict, elapsed = measure_links(ctx, hosts, message_bytes=int(args.link_mib * 2**20),
                                                   min_bandwidth_mb_s=args.min_bandwidth)
            if ctx.is_rank_zero:
                print(format_links(plan, verdict, elapsed), flush=True)
            healthy = verdict.healthy
    return 0 if healthy else 1


def _cmd_train(args: argparse.Namespace) -> int:
    from ddp_hpc.config import load_config
    from ddp_hpc.stop import parse_stop_signal, stop_signals
    from ddp_hpc.stop_handler import record_stop_signals, recorded_signals

    # Read once, before train_job imports torch (seconds): a config that does not load is
    # one line in a fraction of a second.
    config = load_config(args.config, list(args.overrides))
    # Before torch is imported: a stop signal during start-up (a scheduler may send it at
    # any moment of a short job) is kept for the trainer instead of killing the rank.
    record_stop_signals(recorded_signals(stop_signals(parse_stop_signal(config.checkpoint.stop_signal))))
    from ddp_hpc.engine.collectives import enable_flight_recorder
    from ddp_hpc.training.run_on_rank import TrainOptions, train

    # Before the process group starts: the watchdog then names the collective each rank is at.
    enable_flight_recorder(os.environ)

    options = TrainOptions(device=args.device, backend=args.backend, handle_signals=True, configure_logs=True,
                           verbose=args.verbose, report=True,
                           console=ConsoleFilter.from_environment(args.console_ranks, os.environ))
    summary = train(config, options=options, config_path=args.config)
    if summary.preempted:  # not an error: the run goes on when run again
        write_line(sys.stderr, f"ddp-hpc: {_with_rank(args, summary.stop_line())}")
    return summary.exit_status


def _cmd_run(args: argparse.Namespace) -> NoReturn:
    from ddp_hpc.run.torchrun_env import command_environment
    from ddp_hpc.run.python_command import runner_argv

    launch = command_environment(args.command, device=args.device, backend=args.backend,
                                 host_suffix=args.host_suffix)
    # A Python command runs through script_runner.py, which ends the process group in
    # order after the script (a group left to interpreter exit can abort it with 134).
    argv = launch.argv if args.exec else runner_argv(launch.argv)
    log = logging.getLogger("ddp_hpc.run")
    log.debug("exec %s with %s", shlex.join(argv), " ".join(f"{k}={v}" for k, v in launch.exported.items()))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # exec, not a child: signals from the launcher reach the command itself, and its
        # exit status is the rank's.
        os.execvpe(argv[0], list(argv), launch.environment(os.environ))
    except OSError as exc:
        write_line(sys.stderr, f"ddp-hpc: error: cannot run {argv[0]!r}: {exc.strerror}")
        raise SystemExit(ExitStatus.NOT_FOUND if isinstance(exc, FileNotFoundError)
                         else ExitStatus.CANNOT_EXECUTE) from None


def _cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ddp_hpc.tracking.plot import plot_run

    path = plot_run(Path(args.run_folder), Path(args.output) if args.output else None)
    write_line(sys.stdout, str(path))
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ddp_hpc.engine.checkpoint_tools import (convert_checkpoint, format_table, inspect_checkpoints,
                                                 inspect_resumes)

    if args.action == "inspect":
        infos = inspect_checkpoints(args.run)
        write_line(sys.stdout, json.dumps([asdict(i) for i in infos], indent=2) if args.json
                   else format_table(infos, inspect_resumes(args.run)))
        return 0
    write_line(sys.stdout, str(convert_checkpoint(args.run, args.output, step=args.step)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ddp-hpc", description="PyTorch DDP from a laptop to a supercomputer.")
    parser.add_argument("--version", action="version", version=f"ddp-hpc {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    env = sub.add_parser("env", parents=[common],
                         help="print what this rank resolved, without starting a process group")
    env.add_argument("--json", action="store_true", help="one JSON object per rank")
    add_device_flags(env)
    env.set_defaults(func=_cmd_env)

    doctor = sub.add_parser("doctor", parents=[common],
                            help="start the group on every rank and check that it works")
    add_device_flags(doctor)
    add_console_flag(doctor)
    doctor.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="process-group timeout (default: 300)")
    doctor.add_argument("--links", action="store_true",
                        help="also measure bandwidth and latency between the hosts (every pair up to 8 hosts, "
                             "a ring above); exit 1 when a link is slow")
    doctor.add_argument("--link-mib", type=positive_float, default=4.0, metavar="MIB",
                        help="message size of the bandwidth rounds (default: 4)")
    doctor.add_argument("--min-bandwidth", type=positive_float, default=None, metavar="MB/S",
                        help="also call a link slow below this bandwidth (default: only relative to the median)")
    doctor.set_defaults(func=_cmd_doctor, exit_without_teardown=True)

    train = sub.add_parser("train", parents=[common],
                           help="train the job of a config on this rank (under any launcher)")
    train.add_argument("config", nargs="?", default=None,
                       help="YAML config, e.g. configs/digits.yaml (default: the built-in digits job)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="config overrides, e.g. training.batch_size=64")
    add_device_flags(train)
    add_console_flag(train)
    train.set_defaults(func=_cmd_train, exit_without_teardown=True)

    run = sub.add_parser("run", parents=[common],
                         help="run any command on this rank with the variables torchrun gives its workers "
                              "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)")
    add_device_flags(run)
    run.add_argument("--exec", action="store_true",
                     help="exec a Python command as typed, without ddp_hpc's script runner (which ends "
                          "the process group in order after the script)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.set_defaults(func=_cmd_run)

    from ddp_hpc.schedulers import commands
    from ddp_hpc.schedulers.registry import backends, families, run_opts

    for verb, func, help_text in (
            ("render", commands.cmd_render, "write the batch script for a scheduler (nothing is submitted)"),
            ("submit", commands.cmd_submit, f"submit a config or a command ({', '.join(backends())})")):
        verb_parser = sub.add_parser(verb, help=help_text,
                                     description=f"ddp-hpc {verb} SCHEDULER [options] CONFIG [KEY=VALUE...], or "
                                                 f"ddp-hpc {verb} SCHEDULER [options] -- COMMAND [ARGS...]")
        family_parsers = verb_parser.add_subparsers(dest="scheduler", metavar="SCHEDULER", parser_class=Parser)
        family_parsers.required = True
        for family, names in families().items():
            sched = family_parsers.add_parser(family, parents=[common],
                                        help=f"{family.upper()} job ({', '.join(names)})")
            commands.add_job_flags(sched, family)
            sched.add_argument("-o", "--output", help="script path (render: default stdout)")
            if verb == "submit":
                sched.add_argument("--dry-run", action="store_true",
                                   help="print the script and the exact commands; submit nothing")
                sched.add_argument("--wait", action="store_true",
                                   help="wait for the job to end; print its state, exit status and result")
                sched.add_argument("--poll", type=float, default=2.0, help="seconds between status checks")
            for opt in run_opts(family, "backend"):  # each backend's own options (--sbatch)
                opt.add_to(sched)
            sched.set_defaults(func=func)

    for verb, func, help_text in (
            ("status", commands.cmd_status, "the state of a submitted job"),
            ("cancel", commands.cmd_cancel, "cancel a submitted job"),
            ("logs", commands.cmd_logs, "print (or follow) a submitted job's output")):
        job_parser = sub.add_parser(verb, parents=[common], help=help_text)
        job_parser.add_argument("target", metavar="JOB_ID|RUN_FOLDER",
                                help="a run folder (runs/NAME), or a job id submitted from this folder")
        if verb == "logs":
            job_parser.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
            job_parser.add_argument("-n", "--lines", type=int, default=40, help="lines per file (default: 40)")
            job_parser.add_argument("--poll", type=float, default=2.0, help="seconds between checks with -f")
        job_parser.set_defaults(func=func)

    from ddp_hpc.schedulers.cluster.verbs import add_cluster_parser

    add_cluster_parser(sub, common)

    port = sub.add_parser("port", parents=[common],
                          help="print the rendezvous port derived from a job id ($PBS_JOBID, $SLURM_JOB_ID)")
    port.add_argument("job_id", nargs="?")
    port.set_defaults(func=commands.cmd_port)

    add_bench_parser(sub, common)

    checkpoint = sub.add_parser("checkpoint", help="inspect a run's checkpoints, or convert a sharded one to one file")
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION", parser_class=Parser)
    actions.required = True
    inspect = actions.add_parser("inspect", parents=[common],
                                 help="each checkpoint's step, format, size, world size, complete or not")
    inspect.add_argument("run", metavar="RUN", help="a run folder, e.g. runs/digits")
    inspect.add_argument("--json", action="store_true", help="JSON instead of a table")
    convert = actions.add_parser("convert", parents=[common],
                                 help="a sharded (dcp) checkpoint as one torch.save file, for inference")
    convert.add_argument("run", metavar="RUN", help="a run folder, e.g. runs/digits")
    convert.add_argument("output", metavar="OUT.pt", help="the file to write")
    convert.add_argument("--step", type=int, default=None, help="that step's checkpoint (default: the newest complete)")
    for action in (inspect, convert):
        action.set_defaults(func=_cmd_checkpoint)

    plot = sub.add_parser("plot", parents=[common],
                          help="draw a run folder's training curves as a PNG (also while it runs)")
    plot.add_argument("run_folder", help="e.g. runs/digits")
    plot.add_argument("-o", "--output", help="PNG path (default: RUN_FOLDER/curves.png)")
    plot.set_defaults(func=_cmd_plot)

    add_stage_parser(sub, common)

    add_launch_parser(sub, common)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, letting KEY=VALUE overrides stand anywhere after the config, even after options.

    Everything after the first ``--`` is the command (run, launch, render, submit) and is
    never read as options.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = None
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    args, extra = parser.parse_known_args(argv)
    config = getattr(args, "config", None)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        # An optional config followed by overrides: the first override landed in ``config``.
        extra, args.config = [config, *extra], None
    if command is not None:
        if not hasattr(args, "command"):
            parser.error(f"'ddp-hpc {args.command_name}' takes no command after '--'")
        args.command = command
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            traceback.print_exc()
        if not getattr(exc, "reported", False):  # a rank's refusal logged its line already
            write_line(sys.stderr, f"ddp-hpc: error: {_with_rank(args, str(exc))}")
        return exc.exit_code
    except KeyboardInterrupt:
        return ExitStatus.INTERRUPTED
    except Exception as exc:
        status = getattr(type(exc), "one_line_status", None)
        if isinstance(status, int) and not args.debug:  # in-job recovery given up: the fall-back, not a bug
            write_line(sys.stderr, f"ddp-hpc: {_with_rank(args, str(exc))}")
            return status
        if not getattr(args, "exit_without_teardown", False):
            raise
        traceback.print_exc()  # a rank's bug: its traceback, then end the job (main)
        return ExitStatus.FAILED


def _with_rank(args: argparse.Namespace, message: str) -> str:
    """Commands that run on every rank say which rank and host an error comes from."""
    from ddp_hpc.startup.fail_fast import with_rank

    return with_rank(message) if getattr(args, "exit_without_teardown", False) else message


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    configure_logging(None, verbose=args.verbose)
    if args.debug:  # what this process starts (a launch's ranks) shows its tracebacks too
        os.environ[DEBUG_VAR] = "1"
    code = _run(args)
    if getattr(args, "exit_without_teardown", False):
        # Commands that ran a process group end here, after it was destroyed and every
        # file was written: gloo's C++ threads can otherwise abort the interpreter's
        # final teardown (SIGABRT, "terminate called without an active exception"),
        # turning a finished job into exit code 134 now and then.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        from ddp_hpc.startup.fail_fast import end_job

        end_job(code)  # where the launcher would let the other ranks wait (MPICH's Hydra, plain srun)
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

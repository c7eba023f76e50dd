"""``ddp-hpc``: the command line. Each subcommand is a small function over typed values."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from ddp_hpc.contract import (
    BACKEND_VAR,
    CONSOLE_RANKS_VAR,
    DEBUG_VAR,
    DEVICE_VAR,
    HOST_SUFFIX_VAR,
    STAGE_ROOT_VAR,
    RECOVERY_STORE_VAR,
    RUN_FOLDER_VAR,
    STAGE_TIME_IMPORT_VAR,
    ExitStatus,
)
from ddp_hpc.errors import UserError
from ddp_hpc.launch.registry import CHOICES as LAUNCHER_CHOICES
from ddp_hpc.logs import ConsoleFilter, configure_logging
from ddp_hpc.stop import stop_signal_arg
from ddp_hpc.version import __version__


def write_line(stream, text: str) -> None:
    """One write per line: several ranks share the launcher's output, and print() under
    unbuffered output writes the newline separately, so lines of two ranks could merge."""
    stream.write(text + "\n")
    stream.flush()


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitStatus.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _add_device_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("device and backend")
    group.add_argument("--device", help=f"auto, xpu, cuda or cpu (default: ${DEVICE_VAR}, else auto)")
    group.add_argument("--backend", help=f"auto, nccl, xccl, ccl or gloo (default: ${BACKEND_VAR}, else auto)")
    group.add_argument("--host-suffix", default=None,
                       help="suffix for rank 0's host name, e.g. a high-speed network's (default: "
                            f"${HOST_SUFFIX_VAR})")


def _add_console_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--console-ranks", default=None, metavar="RANKS",
                        help="ranks whose INFO lines reach the console: 0 (default), 0,3, 0-3, all or none; "
                             f"every rank's warnings and errors always do (default: ${CONSOLE_RANKS_VAR})")


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


def _cmd_bench(args: argparse.Namespace) -> int:
    from ddp_hpc.bench.command import bench

    return bench(args)


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


def _cmd_stage_pack(args: argparse.Namespace) -> int:
    from ddp_hpc.staging import pack_environment

    packed = pack_environment(args.env, args.archive)
    action = "packed" if packed.written else "up to date:"
    write_line(sys.stderr, f"ddp-hpc: stage: {action} {packed.kind} {packed.prefix} -> {packed.archive} "
                           f"({packed.size_bytes / 1e6:.0f} MB)")
    write_line(sys.stdout, str(packed.archive))
    return 0


def _cmd_stage_fan_out(args: argparse.Namespace) -> int:
    from ddp_hpc.staging import compare_import, node_slot, stage_on_node

    root = args.root or os.environ.get(STAGE_ROOT_VAR)
    if not root:
        raise UserError(f"no node-local folder: give --root DIR or set ${STAGE_ROOT_VAR}")
    slot = node_slot(os.environ)
    suffix = os.environ.get(HOST_SUFFIX_VAR, "") if args.host_suffix is None else args.host_suffix
    copy = stage_on_node(args.archive, root, args.rendezvous, slot, host_suffix=suffix, timeout_s=args.timeout)
    write_line(sys.stdout, f"ddp_hpc: stage: node {slot.index}/{slot.count} ({slot.name}): {copy.path} from "
                           f"{copy.source}, {copy.size_bytes / 1e6:.0f} MB in {copy.seconds:.2f} s")
    modules = args.time_import or [m for m in os.environ.get(STAGE_TIME_IMPORT_VAR, "").split(",") if m]
    for module in modules:
        shared, staged = compare_import(copy, module)
        write_line(sys.stdout, f"ddp_hpc: stage: node {slot.name}: import {module}: {shared.seconds:.2f} s from the "
                               f"shared copy ({shared.module_file}), {staged.seconds:.2f} s from the node-local "
                               f"copy ({staged.module_file})")
    return 0


def _add_stage_parser(sub, common: argparse.ArgumentParser) -> None:
    stage = sub.add_parser("stage", help="copy the Python environment to node-local disk on every node "
                                         "(--stage-env of render/submit does it for you)")
    steps = stage.add_subparsers(dest="stage_step", metavar="STEP", parser_class=_Parser)
    steps.required = True
    pack = steps.add_parser("pack", parents=[common],
                            help="pack the environment once into a relocatable tar file; print its path")
    pack.add_argument("--env", help="the venv or conda environment (default: the active one)")
    pack.add_argument("--archive", help="the tar file (default: ~/.cache/ddp_hpc/stage/NAME-HASH.tar)")
    pack.set_defaults(func=_cmd_stage_pack)
    fan_out = steps.add_parser("fan-out", parents=[common],
                               help="run once per node (srun --ntasks-per-node=1, mpiexec -ppn 1): receive the "
                                    "archive from the parent node, send it on to two more, unpack it to ROOT/NODE")
    fan_out.add_argument("archive", help="the tar file from `ddp-hpc stage pack` (read by node 0 only)")
    fan_out.add_argument("--rendezvous", required=True, metavar="DIR",
                         help="a fresh folder on the shared file system where the nodes find each other")
    fan_out.add_argument("--root", help=f"node-local folder of the copies (default: ${STAGE_ROOT_VAR})")
    fan_out.add_argument("--timeout", type=_positive_float, default=600.0,
                         help="seconds a node waits for its copy (default: 600)")
    fan_out.add_argument("--host-suffix", default=None,
                         help=f"suffix for this node's host name, e.g. a high-speed network's (default: "
                              f"${HOST_SUFFIX_VAR})")
    fan_out.add_argument("--time-import", action="append", default=[], metavar="MODULE",
                         help="then time `import MODULE` from the shared environment and from the copy (repeatable; "
                              f"default: ${STAGE_TIME_IMPORT_VAR}, comma-separated)")
    fan_out.set_defaults(func=_cmd_stage_fan_out)


def _add_cluster_parser(sub, common: argparse.ArgumentParser) -> None:
    from ddp_hpc.schedulers.cluster import verbs
    from ddp_hpc.schedulers.registry import families

    cluster = sub.add_parser("cluster", help="a cluster profile from the scheduler (probe), checked against it "
                                             "(check), or found for this machine (which)")
    steps = cluster.add_subparsers(dest="cluster_step", metavar="STEP", parser_class=_Parser)
    steps.required = True
    probe = steps.add_parser("probe", parents=[common],
                             help="ask the scheduler (and, inside a job, the node) and write a commented profile; "
                                  "read-only, submits nothing")
    probe.add_argument("--scheduler", choices=("slurm", "pbs"), help="default: the one that answers")
    probe.add_argument("--out", metavar="FILE", help="the profile to write (default: stdout), e.g. "
                                                     "configs/clusters/NAME.yaml")
    probe.set_defaults(func=verbs.cmd_probe)
    check = steps.add_parser("check", parents=[common],
                             help="the profile against the cluster: one line per mismatch, exit 2 on any")
    check.add_argument("profile", metavar="PROFILE", help="a profile name or YAML path")
    check.add_argument("--walltime", "--time", dest="walltime", default="01:00:00",
                       help="the walltime to check against the partition's limit (default: 01:00:00)")
    check.add_argument("--nodes", type=int, default=1, help="the nodes to check against the partition's (default: 1)")
    check.set_defaults(func=verbs.cmd_check)
    which = steps.add_parser("which", parents=[common],
                             help="the profile render/submit use here without --cluster, and why")
    which.add_argument("--scheduler", choices=tuple(families()), help="only profiles of this family")
    which.set_defaults(func=verbs.cmd_which)


def _cmd_launch(args: argparse.Namespace) -> int:
    from ddp_hpc.launch.entry import launch
    from ddp_hpc.launch.spec import from_arguments

    return launch(from_arguments(args, os.environ, sys.argv), signal.signal)


def _cmd_record_exit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ddp_hpc.launch.restart import record_exit

    record_exit(Path(args.run_folder), args.job_id, args.status)
    return 0


def _cmd_record_stop(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ddp_hpc.contract import PREEMPTED_MARKER, mark_stopped

    mark_stopped(Path(args.run_folder) / PREEMPTED_MARKER)
    return 0


def _exit_status(text: str) -> int:
    if not text.isdigit() or int(text) > 255:
        raise argparse.ArgumentTypeError(f"not an exit status (0-255): {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddp-hpc", description="PyTorch DDP from a laptop to a supercomputer.")
    parser.add_argument("--version", action="version", version=f"ddp-hpc {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    env = sub.add_parser("env", parents=[common],
                         help="print what this rank resolved, without starting a process group")
    env.add_argument("--json", action="store_true", help="one JSON object per rank")
    _add_device_flags(env)
    env.set_defaults(func=_cmd_env)

    doctor = sub.add_parser("doctor", parents=[common],
                            help="start the group on every rank and check that it works")
    _add_device_flags(doctor)
    _add_console_flag(doctor)
    doctor.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="process-group timeout (default: 300)")
    doctor.add_argument("--links", action="store_true",
                        help="also measure bandwidth and latency between the hosts (every pair up to 8 hosts, "
                             "a ring above); exit 1 when a link is slow")
    doctor.add_argument("--link-mib", type=_positive_float, default=4.0, metavar="MIB",
                        help="message size of the bandwidth rounds (default: 4)")
    doctor.add_argument("--min-bandwidth", type=_positive_float, default=None, metavar="MB/S",
                        help="also call a link slow below this bandwidth (default: only relative to the median)")
    doctor.set_defaults(func=_cmd_doctor, exit_without_teardown=True)

    train = sub.add_parser("train", parents=[common],
                           help="train the job of a config on this rank (under any launcher)")
    train.add_argument("config", nargs="?", default=None,
                       help="YAML config, e.g. configs/digits.yaml (default: the built-in digits job)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="config overrides, e.g. training.batch_size=64")
    _add_device_flags(train)
    _add_console_flag(train)
    train.set_defaults(func=_cmd_train, exit_without_teardown=True)

    run = sub.add_parser("run", parents=[common],
                         help="run any command on this rank with the variables torchrun gives its workers "
                              "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)")
    _add_device_flags(run)
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
        family_parsers = verb_parser.add_subparsers(dest="scheduler", metavar="SCHEDULER", parser_class=_Parser)
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

    _add_cluster_parser(sub, common)

    port = sub.add_parser("port", parents=[common],
                          help="print the rendezvous port derived from a job id ($PBS_JOBID, $SLURM_JOB_ID)")
    port.add_argument("job_id", nargs="?")
    port.set_defaults(func=commands.cmd_port)

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
    bench.add_argument("--goodput-minutes", type=_positive_float, default=5.0, metavar="M",
                       help="with --goodput: minutes each arm runs, per round (default: 5)")
    bench.add_argument("--goodput-interval", type=_positive_float, default=30.0, metavar="S",
                       help="with --goodput: seconds between faults (default: 30)")
    bench.add_argument("--goodput-ranks", type=int, default=4, metavar="N",
                       help="with --goodput: world size (default: 4)")
    bench.add_argument("--goodput-fault", choices=("kill", "hang", "mixed"), default="kill",
                       help="with --goodput: SIGKILL of a rank, SIGSTOP (a hung rank, found by the hang timeout), "
                            "or either, drawn per fault (default: kill)")
    bench.add_argument("--goodput-step-work", type=float, default=0.0, metavar="S",
                       help="with --goodput: seconds of the loop's own work after each optimizer step, before "
                            "step_done, so that faults land there too (default: 0)")
    bench.add_argument("--goodput-hang-timeout", type=_positive_float, default=5.0, metavar="S",
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

    checkpoint = sub.add_parser("checkpoint", help="inspect a run's checkpoints, or convert a sharded one to one file")
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
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

    _add_stage_parser(sub, common)

    launch = sub.add_parser("launch", parents=[common],
                            help="start N ranks of a command on this machine (or on the hosts of --hostfile)")
    launch.add_argument("--nproc", type=int, default=2,
                        help="number of ranks (default: 2); with --hostfile, ranks per host")
    launch.add_argument("--launcher", default="local", choices=LAUNCHER_CHOICES,
                        help="local (default): ddp-hpc starts the ranks itself with torchrun's variables (the "
                             "old name torchrun still works); "
                             "openmpi, mpich: mpiexec starts them; pals: Cray PALS's mpiexec, with --hostfile "
                             "only (a PBS job's nodes); srun: one srun step per attempt, inside a "
                             "SLURM allocation (--nodes of its nodes, --nproc ranks each; its other nodes are "
                             "spares a restart takes in place of a node where a rank failed); a site's package may add "
                             "its own (docs/run.md)")
    launch.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="relaunch all ranks after a failure, at most N times; they resume from the newest "
                             "checkpoint. A stop (exit 75) is never restarted: the launch exits 75")
    launch.add_argument("--recover", type=int, default=0, metavar="N",
                        help="in-job recovery (DDP and FSDP2 loops that use InJobRecovery): replace a lost or frozen rank "
                             "while the others stay up, at most N times; state comes from the survivors' memory, no "
                             "restart. Beyond N: --max-restarts. Under --launcher local this launch watches the "
                             "ranks; under mpich, openmpi and srun, and with --hostfile, the launcher starts one node "
                             "supervisor per node (--node-supervisor) that does. Over gloo or nccl "
                             f"(${BACKEND_VAR} xccl or ccl is refused)")
    launch.add_argument("--recovery-wait", type=_positive_float, default=120.0, metavar="S",
                        help="with --recover: seconds the ranks wait for the new group (default: 120)")
    launch.add_argument("--shrink", action="store_true",
                        help="with --recover: go on without the lost rank instead of starting a replacement")
    launch.add_argument("--warm-spare", action="store_true",
                        help="with --recover: keep one more process of the command waiting in InJobRecovery (torch "
                             "imported): a lost rank's place goes to it, without a Python start")
    launch.add_argument("--hang-timeout", type=_positive_float, default=10.0, metavar="S",
                        help="with --recover: a rank whose heartbeat stands still S seconds is frozen: it is "
                             "killed and recovered (default: 10)")
    launch.add_argument("--node-supervisor", action="store_true",
                        help="run as one node's supervisor of a `launch --recover` under mpiexec or srun, which "
                             "starts it once per node (mpiexec -ppn 1, srun --ntasks-per-node=1) with the recovery "
                             f"store's address in ${RECOVERY_STORE_VAR}: starts --nproc ranks of this node (its place "
                             "from the launcher's variables) and replaces a lost one; no restarts of its own")
    launch.add_argument("--hostfile", metavar="FILE",
                        help="start the ranks on these hosts (one name per line) with mpiexec (--launcher openmpi "
                             "or mpich): --nproc ranks on each of the first --nodes; the rest are spares a restart "
                             "takes in place of a host where a rank failed")
    launch.add_argument("--nodes", type=int, default=None, metavar="N",
                        help="with --hostfile: hosts to run on (default: every host in the file); with --launcher "
                             "srun: nodes of the allocation (default: all of them)")
    launch.add_argument("--run-folder", metavar="DIR",
                        help="with --hostfile: where the launch keeps each attempt's host file, its exit status and left-out hosts "
                             f"(ddp-hpc status DIR); with --launcher srun: the same (default: ${RUN_FOLDER_VAR}); on "
                             "this machine: where it writes exit-<its pid> and reads the ranks' preempted marker")
    launch.add_argument("--stop-signal", type=stop_signal_arg, default=None, metavar="NAME",
                        help="with --launcher srun: the signal that asks the ranks to stop (a batch script's "
                             "--signal; default: USR2); srun passes SIGUSR2 on to the ranks. With --hostfile: a "
                             "stop signal besides USR2 and TERM (a PBS script's --stop-signal), passed on as the "
                             "signal mpiexec passes on")
    launch.add_argument("--mpiexec", metavar="PROGRAM", default=None,
                        help="with --hostfile: the mpiexec to run (default: the --launcher flavour's first on PATH; "
                             "a PBS script passes the one it looked up)")
    launch.add_argument("--cpu-bind", metavar="VALUE", default=None,
                        help="with --hostfile and --launcher pals: mpiexec's --cpu-bind (a cluster profile's cpu_bind)")
    launch.add_argument("--depth", type=int, metavar="N", default=None,
                        help="with --hostfile and --launcher pals: mpiexec's --depth, cores per rank (a cluster "
                             "profile's depth)")
    launch.add_argument("--host-suffix", metavar="SUFFIX", default=None,
                        help="with --hostfile: rank 0's address is its host's short name followed by SUFFIX (a "
                             "cluster profile's host_suffix: the high-speed network's name), at every attempt")
    launch.add_argument("--job-id", metavar="ID", default=None,
                        help="with --hostfile: the scheduler's job this launch runs in (a PBS script passes "
                             "\"$PBS_JOBID\"): the launch writes RUN/exit-ID and records no job of its own "
                             "(without it: a local job, its pid the job id)")
    launch.add_argument("--requeue", action="store_true",
                        help="with --launcher srun: after a stop (75), requeue this SLURM job (scontrol requeue) "
                             "instead of writing its exit status")
    launch.add_argument("--torchrun", metavar="HOST:PORT", default=None,
                        help="with --launcher srun: one torchrun per node starts its --nproc ranks (c10d rendezvous "
                             "at HOST:PORT; torchrun itself never restarts); the stop reaches them as SIGTERM")
    launch.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    launch.set_defaults(func=_cmd_launch)

    # Internal, left out of the help: a rendered script whose job ends before its launch starts
    # (a failed staging or pre-flight) records the job's exit status through the launch's one writer.
    record = sub.add_parser("record-exit", parents=[common])
    record.add_argument("run_folder")
    record.add_argument("job_id")
    record.add_argument("status", type=_exit_status)
    record.set_defaults(func=_cmd_record_exit)
    # Internal too: the rank wrapper under mpiexec says rank 0 stopped (exit 75) through the
    # marker's one writer, which StopAgreement's rank 0 calls.
    stopped = sub.add_parser("record-stop", parents=[common])
    stopped.add_argument("run_folder")
    stopped.set_defaults(func=_cmd_record_stop)
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

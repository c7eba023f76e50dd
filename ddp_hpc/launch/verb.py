"""``ddp-hpc launch``: its parser and entry (the CLI adds it, ``cli.py``), and the two internal
verbs the rendered scripts and rank wrappers call, ``record-exit`` and ``record-stop``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from ddp_hpc.cli_args import positive_float
from ddp_hpc.contract import BACKEND_VAR, RECOVERY_STORE_VAR, RUN_FOLDER_VAR
from ddp_hpc.launch.registry import CHOICES as LAUNCHER_CHOICES
from ddp_hpc.stop import stop_signal_arg


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


def add_launch_parser(sub: Any, common: argparse.ArgumentParser) -> None:
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
    launch.add_argument("--recovery-wait", type=positive_float, default=120.0, metavar="S",
                        help="with --recover: seconds the ranks wait for the new group (default: 120)")
    launch.add_argument("--shrink", action="store_true",
                        help="with --recover: go on without the lost rank instead of starting a replacement")
    launch.add_argument("--warm-spare", action="store_true",
                        help="with --recover: keep one more process of the command waiting in InJobRecovery (torch "
                             "imported): a lost rank's place goes to it, without a Python start")
    launch.add_argument("--hang-timeout", type=positive_float, default=10.0, metavar="S",
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

"""``ddp-hpc render`` and ``ddp-hpc submit``: from CLI arguments to a script and a job."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ddp_hpc.launch.pbs import render_pbs
from ddp_hpc.launch.profiles import load_profile
from ddp_hpc.launch.request import JobRequest, current_python_env, parse_env_assignments, quote_command
from ddp_hpc.launch.slurm import LOG_DIR, render_sbatch

DEFAULT_PROFILES = {"pbs": "pbs-generic", "slurm": "slurm-cpu"}
SCRIPT_SUFFIX = {"pbs": ".pbs", "slurm": ".sbatch"}


def add_job_flags(parser: argparse.ArgumentParser, scheduler: str) -> None:
    parser.add_argument("config", help="training config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for the job")
    parser.add_argument("--cluster", default=DEFAULT_PROFILES[scheduler],
                        help=f"cluster profile name or YAML path (default: {DEFAULT_PROFILES[scheduler]})")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    parser.add_argument("--ranks-per-node", "--tasks-per-node", dest="ranks_per_node", type=int,
                        help="ranks per node (default: the profile's)")
    parser.add_argument("--walltime", "--time", dest="walltime", default="01:00:00",
                        help="HH:MM:SS, MM:SS or minutes (default: 01:00:00)")
    parser.add_argument("--account", "-A", help="project/account to charge")
    parser.add_argument("--queue", "--partition", "-q", dest="queue", help="queue (PBS) or partition (SLURM)")
    parser.add_argument("--job-name", help="job name (default: the run name)")
    parser.add_argument("--setup", action="append", default=[], metavar="LINE",
                        help="a shell line to run in the job before launching (repeatable)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for every rank (repeatable)")
    parser.add_argument("--no-venv", action="store_true",
                        help="do not activate the current Python environment in the job")
    if scheduler == "slurm":
        parser.add_argument("--torchrun", action="store_true",
                            help="one torchrun per node with a c10d rendezvous, instead of one srun task per rank")


def job_request(args: argparse.Namespace) -> JobRequest:
    return JobRequest(
        config_path=args.config, overrides=tuple(args.overrides), profile=load_profile(args.cluster),
        nodes=args.nodes, walltime=args.walltime, ranks_per_node=args.ranks_per_node, account=args.account,
        queue=args.queue, job_name=args.job_name, setup=tuple(args.setup), env=parse_env_assignments(args.env),
        python_env=None if args.no_venv else current_python_env())


def render(request: JobRequest, scheduler: str, torchrun: bool = False) -> str:
    if request.profile.scheduler != scheduler:
        from ddp_hpc.errors import UserError

        raise UserError(f"cluster profile {request.profile.name!r} is a {request.profile.scheduler} cluster: "
                        f"use 'ddp-hpc render {request.profile.scheduler}' or another --cluster")
    return render_pbs(request) if scheduler == "pbs" else render_sbatch(request, torchrun)


def cmd_render(args: argparse.Namespace) -> int:
    request = job_request(args)
    text = render(request, args.scheduler, getattr(args, "torchrun", False))
    if args.output:
        Path(args.output).write_text(text)
        Path(args.output).chmod(0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _print_summary(summary: dict) -> None:
    test = summary.get("test") or {}
    print(f"job finished: {summary['epochs_completed']} epochs, {summary['global_step']} steps, world size "
          f"{summary['world_size']}, {summary.get('samples_per_s')} samples/s" +
          "".join(f", test {k} {v:.4f}" for k, v in sorted(test.items())))
    print(json.dumps(summary, indent=2, sort_keys=True))


def cmd_submit(args: argparse.Namespace) -> int:
    from ddp_hpc.launch import submit

    request = job_request(args)
    workdir = Path.cwd()
    scheduler = args.scheduler
    use_submitit = scheduler == "slurm" and not args.sbatch and not getattr(args, "torchrun", False)
    script_path = Path(args.output) if args.output else workdir / request.run_folder / f"job{SCRIPT_SUFFIX[scheduler]}"
    text = render(request, scheduler, getattr(args, "torchrun", False))
    per_rank = quote_command(request.train_command())
    if args.dry_run:
        sys.stdout.write(text)
        print(f"\n# per-rank command ({request.world_size} ranks): {per_rank}")
        if use_submitit:
            print("# would submit with submitit (sbatch), one task per rank running the command above")
        else:
            print(f"# would run: {'qsub' if scheduler == 'pbs' else 'sbatch --parsable'} {script_path}")
        return 0
    if use_submitit:
        job_id, summary = submit.submit_with_submitit(request, workdir, args.wait)
    else:
        submit.write_script(text, script_path)
        if scheduler == "slurm":
            (workdir / LOG_DIR).mkdir(exist_ok=True)
        submitted = submit.submit_script("qsub" if scheduler == "pbs" else "sbatch", script_path)
        job_id = submitted.job_id
        print(f"submitted job {job_id} (script {script_path})", flush=True)
        summary = (submit.wait_for_summary(submitted, request, scheduler, workdir, args.poll)
                   if args.wait else None)
    if summary is not None:
        _print_summary(summary)
    return 0


def cmd_port(args: argparse.Namespace) -> int:
    from ddp_hpc.environment.ports import PortRange, derive_port
    from ddp_hpc.errors import UserError

    job_id = args.job_id or os.environ.get("PBS_JOBID") or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError("no job id: give one, or run inside a PBS or SLURM job")
    print(derive_port(job_id, PortRange()))
    return 0

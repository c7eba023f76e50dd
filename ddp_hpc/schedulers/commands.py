"""``ddp-hpc render|submit|status|logs|cancel``: from CLI arguments to the scheduler layer.

A thin adapter: arguments become a ``SubmitRequest``, the registry picks the backend, and the
``DryRun``/``Submission``/``JobResult`` values are printed. No scheduler's name is compared
here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from ddp_hpc.contract import SUBMISSION_FILE, SUBMISSIONS_LOG, SWEEP_INDEX_VAR, SWEEP_VAR_PREFIX
from ddp_hpc.errors import UserError
from ddp_hpc.schedulers import base, registry, runner
from ddp_hpc.launch.left_out import left_out_line
from ddp_hpc.specs.profiles import ClusterProfile, load_profile
from ddp_hpc.specs.request import (
    CommandPayload,
    SubmitRequest,
    TrainPayload,
    current_python_env,
    parse_env_assignments,
)
from ddp_hpc.specs.sweep import Sweep
from ddp_hpc.stop import StopSignal, stop_signal_arg



class JobFailed(UserError):
    """The job ended without success; its exit status (or 1) is ours."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_job_flags(parser: argparse.ArgumentParser, family: str) -> None:
    parser.add_argument("config", nargs="?", help="training config (YAML); or give a command after '--'")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for the job")
    default = registry.default_profile(family)
    parser.add_argument("--cluster", default=default, help=f"cluster profile name or YAML path (default: "
                        f"{default or 'the profile whose match fits this machine: ddp-hpc cluster which'})")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    parser.add_argument("--ranks-per-node", "--tasks-per-node", dest="ranks_per_node", type=int,
                        help="ranks per node (default: the profile's)")
    parser.add_argument("--walltime", "--time", dest="walltime", default="01:00:00",
                        help="HH:MM:SS, MM:SS or minutes (default: 01:00:00)")
    parser.add_argument("--account", "-A", help="project/account to charge")
    parser.add_argument("--queue", "--partition", "-q", dest="queue", help="queue (PBS) or partition (SLURM)")
    parser.add_argument("--job-name", help="job name (default: the run name, or the command's script name)")
    parser.add_argument("--run-dir", default="runs",
                        help="command jobs: folder of run folders (default: runs; config jobs use logging.run_dir)")
    parser.add_argument("--setup", action="append", default=[], metavar="LINE",
                        help="a shell line to run in the job before launching (repeatable)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for every rank (repeatable)")
    parser.add_argument("--max-restarts", type=int, default=None, metavar="N",
                        help="relaunch all ranks in the same allocation after a failure, at most N times "
                             "(they resume from the newest checkpoint; default: the config's "
                             "distributed.max_restarts, else 0); submitit: the job is submitted again "
                             "without the node where a rank failed")
    for opt in registry.run_opts(family, "job"):  # what the family's backends declare
        opt.add_to(parser)
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="run every combination of these values as one array job (repeatable; command jobs "
                             f"get {SWEEP_INDEX_VAR} and {SWEEP_VAR_PREFIX}<KEY>)")
    parser.add_argument("--sweep-limit", type=int, metavar="K", help="at most K sweep elements run at once")
    parser.add_argument("--chain", type=int, default=1, metavar="N",
                        help="submit N jobs, each after the previous one ended (afterany), each resuming the run")
    parser.add_argument("--signal", type=stop_signal_arg, default=None, metavar="SIG@SECONDS",
                        help="SLURM: the signal sent ahead of the job's deadline and how far ahead (default: USR2@90); "
                             "the script passes it to the ranks, which checkpoint and stop")
    parser.add_argument("--preflight", action="store_true",
                        help="before the ranks start, measure the links between the nodes (ddp-hpc doctor --links, "
                             "one rank per node); a slow or broken link ends the job with exit 1")
    parser.add_argument("--stage-env", action="store_true",
                        help="pack the job's Python environment once, copy it to node-local disk on every node "
                             "(a tree over the nodes) and run the ranks from there (rendered PBS/SLURM scripts)")
    parser.add_argument("--stage-dir", default="/tmp", metavar="DIR",
                        help="with --stage-env: the node-local folder for the copy (default: /tmp)")
    parser.add_argument("--no-venv", action="store_true",
                        help="do not activate the current Python environment in the job")
    parser.set_defaults(command=[])


def _payload(args: argparse.Namespace) -> TrainPayload | CommandPayload:
    command = list(args.command or [])
    if command:
        if args.config or args.overrides:
            raise UserError("give a config or a command after '--', not both")
        return CommandPayload(tuple(command), run_dir=args.run_dir)
    if not args.config:
        raise UserError("nothing to run: give a config (configs/digits.yaml) or a command after '--'")
    return TrainPayload(args.config, tuple(args.overrides))


def submit_request(args: argparse.Namespace) -> SubmitRequest:
    payload = _payload(args)
    max_restarts = args.max_restarts
    if max_restarts is None:
        max_restarts = payload.config.distributed.max_restarts if isinstance(payload, TrainPayload) else 0
    # What the family's backends declared (--spare-nodes), into the request fields they name.
    declared = {opt.request_field: getattr(args, opt.dest) for group in ("job", "backend")
                for opt in registry.run_opts(args.scheduler, group) if opt.request_field}
    return SubmitRequest(
        payload=payload, profile=_profile(args), nodes=args.nodes, walltime=args.walltime,
        ranks_per_node=args.ranks_per_node, account=args.account, queue=args.queue, job_name=args.job_name,
        setup=tuple(args.setup), env=parse_env_assignments(args.env),
        python_env=None if args.no_venv else current_python_env(),
        max_restarts=max_restarts, sweep=Sweep.parse(args.sweep, args.sweep_limit), chain=args.chain,
        stop_signal=args.signal or StopSignal.default(), preflight=args.preflight, stage_env=args.stage_env,
        stage_dir=args.stage_dir, **declared)


def _profile(args: argparse.Namespace) -> ClusterProfile:
    if args.cluster:
        return load_profile(args.cluster)
    from ddp_hpc.schedulers.cluster.which import profile_for

    profile, why = profile_for(args.scheduler)
    logging.getLogger(__name__).debug("cluster profile %s (%s): %s", profile.name, profile.path, why)
    return profile


def _scheduler(args: argparse.Namespace) -> str:
    return registry.backend_for(args.scheduler, vars(args)).name


def cmd_render(args: argparse.Namespace) -> int:
    request = submit_request(args)
    plan = runner.dry_run(request, registry.scheduler_for(args.scheduler, batch_script=True).name)
    if args.output:
        base.write_script(plan.script, Path(args.output))
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(plan.script)
    return 0


def print_result(result: runner.JobResult) -> None:
    status = result.status
    code = "unknown" if status.exit_code is None else str(status.exit_code)
    print(f"job {result.submission.job_id}: {status.state.value} (exit status {code}; {status.source or 'no source'}"
          f"{': ' + status.raw if status.raw else ''})")
    if result.elements:
        print(sweep_table(result))
    elif result.summary is not None:
        print(f"job finished: {result.summary.headline()}")
        print(result.summary.to_json(), end="")


def sweep_table(result: runner.JobResult) -> str:
    """One row per sweep element: index, overrides, state, exit status, final metrics."""
    rows = [("element", "overrides", "state", "exit", "result")]
    for element in result.elements:
        summary = element.summary
        metrics = ""
        if summary is not None:
            chosen = ({f"test_{k}": v for k, v in summary.test.items()} if summary.test else
                      {k: v for k, v in summary.final.items() if k.startswith("val_")})
            metrics = " ".join(f"{k}={v:.4f}" for k, v in sorted(chosen.items()) if isinstance(v, float))
        code = "" if element.status.exit_code is None else str(element.status.exit_code)
        rows.append((str(element.element.index), element.element.assignment, element.status.state.value, code,
                     metrics or element.element.run_folder))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def cmd_submit(args: argparse.Namespace) -> int:
    request = submit_request(args)
    scheduler = _scheduler(args)
    script_path = Path(args.output).resolve() if args.output else None
    if args.dry_run:
        sys.stdout.write(runner.dry_run(request, scheduler, script_path=script_path).describe())
        return 0
    submission = runner.submit(request, scheduler, script_path=script_path)
    print(f"submitted job {submission.job_id} ({submission.location}; run folder {submission.run_folder})",
          flush=True)
    if not args.wait:
        return 0
    return _report_end(runner.wait(submission, poll_s=args.poll))


def _report_end(result: runner.JobResult) -> int:
    print_result(result)
    if result.succeeded:
        if result.submission.kind == "command":
            print(result.log_tail)
        return 0
    if result.failure:  # the backend's own line: "job ID failed: rank(s) ... ; logs in ..."
        raise JobFailed(f"{result.failure}; {result.log_tail}", result.exit_code)
    code = result.status.exit_code
    reason = ("ended without a training summary" if result.submission.kind == "train" else
              f"the command ended with exit status {code}" if code is not None else "the job ended abnormally")
    raise JobFailed(f"job {result.submission.job_id} {result.status.state.value}: {reason}; {result.log_tail}",
                    result.exit_code)


def _find_submission(target: str) -> base.Submission:
    """A run folder, a submission record, or a job id recorded under ./runs."""
    path = Path(target)
    if path.exists():
        return runner.read_submission(path)
    for record in sorted(Path.cwd().glob(f"*/*/{SUBMISSION_FILE}")) + sorted(
            Path.cwd().glob(f"*/*/{SUBMISSIONS_LOG}")):
        lines = record.read_text().splitlines() if record.suffix == ".jsonl" else [record.read_text()]
        for text in lines:
            try:
                submission = base.Submission.from_json(text)
            except (ValueError, TypeError):
                continue
            if submission.job_id == target or submission.job_id.split(".")[0] == target:
                return submission
    raise UserError(f"{target!r} is neither a run folder nor a job id recorded under {Path.cwd()}/*/*/: "
                    "give the run folder (e.g. runs/digits)")


def cmd_status(args: argparse.Namespace) -> int:
    submission = _find_submission(args.target)
    scheduler = registry.get_scheduler(submission.scheduler)
    status = scheduler.status(submission)
    result = runner.job_result(scheduler, submission, status) if status.state.is_terminal else None
    age = time.time() - submission.submitted_at
    print(f"job {submission.job_id} ({submission.scheduler}, {submission.world_size} ranks, submitted "
          f"{age / 60:.1f} min ago): {status.state.value}" +
          (f", exit status {status.exit_code}" if status.exit_code is not None else "") +
          (f" [{status.source}: {status.raw}]" if status.raw else ""))
    print(f"run folder: {submission.run_folder}")
    left_out = left_out_line(Path(submission.run_folder))
    if left_out:
        print(left_out)
    if result is not None and result.summary is not None:
        print(f"result: {result.summary.headline()}")
    if result is not None and result.failure:
        print(f"failure: {result.failure}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    submission = _find_submission(args.target)
    registry.get_scheduler(submission.scheduler).cancel(submission)
    print(f"cancel requested for job {submission.job_id} ({submission.scheduler})")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    submission = _find_submission(args.target)
    scheduler = registry.get_scheduler(submission.scheduler)
    if not args.follow:
        print(runner.log_tail(scheduler, submission, args.lines))
        return 0
    offsets: dict[Path, int] = {}
    while True:  # like tail -f, over every log file of the job, until the job ends
        for path in scheduler.log_files(submission):
            with open(path, "rb") as handle:
                handle.seek(offsets.get(path, 0))
                chunk = handle.read()
                offsets[path] = handle.tell()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        if scheduler.status(submission).state.is_terminal:
            return 0
        time.sleep(args.poll)


def cmd_port(args: argparse.Namespace) -> int:
    from ddp_hpc.environment.base import scheduler_job_id
    from ddp_hpc.environment.jobs import job_id_variables
    from ddp_hpc.environment.ports import PortRange, derive_port

    job_id = args.job_id or (scheduler_job_id(os.environ) or (None, None))[1]
    if not job_id:
        raise UserError(f"no job id: give one, or run inside a job that sets "
                        f"{' or '.join('$' + name for name in job_id_variables())}")
    print(derive_port(job_id, PortRange()))
    return 0

"""``local``: the minimal example backend. It renders a bash script and runs it with bash on
this machine, in the background: no scheduler, and the same script pieces as the others
(run folder, the stop signal, restarts, the exit file that ``status`` reads).

A whole scheduler family: this package (the ``Scheduler`` subclass below, and its
``__init__.py``'s ``FAMILY``) plus its entry point in pyproject.toml (``ddp_hpc.schedulers``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ddp_hpc.errors import UserError
from ddp_hpc.specs.request import SubmitRequest
from ddp_hpc.contract import LOCAL_SCHEDULER, RUN_FOLDER_VAR
from ddp_hpc.launch.script import ShellVar, environment_block, header_comment, rank_argv, render_argv, run_folder_lines
from ddp_hpc.schedulers.base import DryRun, JobState, JobStatus, Scheduler, Submission, read_exit_file, write_script

log = logging.getLogger(__name__)

#: The profiles this family serves: ``scheduler: local`` (``none`` is the older spelling).
PROFILE_SCHEDULERS = ("local", "none")


def render_local(request: SubmitRequest) -> str:
    """A bash script that becomes ``ddp-hpc launch`` (``exec``) for every rank on this machine:
    the one supervisor and restart policy, and the exit file ``exit-<job id>`` (the script's
    pid, which the launch keeps)."""
    argv = ["ddp-hpc", "launch", "--launcher", request.profile.launcher, "--nproc", str(request.per_node), "--max-restarts", str(request.max_restarts),
            "--run-folder", ShellVar(RUN_FOLDER_VAR), "--", *rank_argv(request)]
    lines = [
        "#!/bin/bash",
        header_comment(request, "local"),
        "set -euo pipefail",
        *environment_block(request),
        "",
        *run_folder_lines(request, "PWD"),
        # Ignored until the launch installs its own handlers (an ignored signal survives exec).
        "trap '' USR2 TERM",
        f"exec {render_argv(argv)}",
        "",
    ]
    return "\n".join(lines)


class LocalScheduler(Scheduler):
    name = LOCAL_SCHEDULER
    family = "local"
    script_suffix = ".sh"
    launchers = ("local",)

    def check_profile(self, request: SubmitRequest) -> None:
        if request.profile.scheduler not in PROFILE_SCHEDULERS:
            raise UserError(f"cluster profile {request.profile.name!r} is a {request.profile.scheduler} cluster: "
                            f"use 'ddp-hpc render {request.profile.scheduler}' or --cluster local")
        self.check_launcher(request)
        if (request.nodes != 1 or request.sweep is not None or request.chain != 1 or request.spare_nodes
                or request.stage_env):
            raise UserError("the local scheduler runs one job on this machine: --nodes 1, "
                            "no --sweep, --chain, --spare-nodes or --stage-env")

    def dry_run(self, request: SubmitRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        self.check_profile(request)
        script_path = script_path or workdir / request.run_folder / f"job{self.script_suffix}"
        return DryRun(self.name, request, workdir, tuple(request.rank_command()), script=render_local(request),
                      script_path=script_path, submit_argv=("bash", str(script_path)))

    def submit(self, dry_run: DryRun) -> Submission:
        write_script(dry_run.script, dry_run.script_path)
        log = dry_run.run_folder / "job.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as output:
            # Its own session: cancel ends the script and every rank it started, and the
            # job outlives the submitting process.
            process = subprocess.Popen(list(dry_run.submit_argv), cwd=dry_run.workdir, stdin=subprocess.DEVNULL,
                                       stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        return self._submission(dry_run, [str(process.pid)], [str(log)], dry_run.submit_argv)

    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        code = read_exit_file(exit_file)
        if code is not None:
            return JobStatus(JobState.COMPLETED if code == 0 else JobState.FAILED, code, str(code), "exit file")
        if _alive(int(job_id)):
            return JobStatus(JobState.RUNNING, None, "running", "process")
        return JobStatus(JobState.UNKNOWN, None, "", "")

    def cancel_jobs(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            pid = int(job_id)
            try:
                # A rendered script runs in a session of its own: its group holds every rank. A
                # `launch --hostfile` runs in its caller's group: it ends its ranks itself.
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGTERM)
                else:
                    os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    """A process that has not ended (a zombie, not yet reaped by its parent, has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"

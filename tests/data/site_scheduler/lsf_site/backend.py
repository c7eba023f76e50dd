"""LSF through a rendered ``#BSUB`` script handed to ``bsub`` on its standard input (LSF reads
the ``#BSUB`` lines of a script only there). The script's words are quoted by ddp_hpc's one
quoting function (``render_argv`` over ``shell_quote``). One job at a time: no sweeps (LSF's job arrays),
chains or staging, which a real family would add."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ddp_hpc.contract import RUN_FOLDER_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.launch.script import (
    ShellVar,
    deadline_line,
    environment_block,
    header_comment,
    rank_argv,
    render_argv,
    run_folder_lines,
)
from ddp_hpc.schedulers.base import (
    DryRun,
    JobState,
    JobStatus,
    Scheduler,
    Submission,
    query_tool,
    read_exit_file,
    run_tool,
    write_script,
)
from ddp_hpc.specs.request import SubmitRequest, directive_value, job_name_directive

#: bsub's answer: ``Job <1234> is submitted to queue <normal>.``
_SUBMITTED = re.compile(r"Job <(\d+)> is submitted")
#: bjobs' STAT -> ours; DONE and EXIT leave the exit file behind, which is read first.
_STATES = {"PEND": JobState.PENDING, "PSUSP": JobState.PENDING, "RUN": JobState.RUNNING,
           "USUSP": JobState.RUNNING, "SSUSP": JobState.RUNNING, "DONE": JobState.COMPLETED,
           "EXIT": JobState.FAILED}


def render_lsf(request: SubmitRequest) -> str:
    """The job's script (pure): the directives, the job's hosts once each, rank 0's address,
    then ``exec ddp-hpc launch`` over those hosts (the restarts, the stop, the exit file)."""
    minutes = -(-request.walltime_s // 60)
    name = job_name_directive(request.name)
    lines = ["#!/bin/bash", f"#BSUB -J {name}", f"#BSUB -n {request.world_size}",
             f'#BSUB -R "span[ptile={request.per_node}]"', f"#BSUB -W {minutes // 60}:{minutes % 60:02d}"]
    if request.resolved_account:
        lines.append(f"#BSUB -P {directive_value(request.resolved_account, 'account')}")
    if request.resolved_queue:
        lines.append(f"#BSUB -q {directive_value(request.resolved_queue, 'queue')}")
    lines += [f"#BSUB -o {name}.%J.out", f"#BSUB -e {name}.%J.err"]
    argv = ["ddp-hpc", "launch", "--launcher", request.profile.launcher, "--hostfile", ShellVar("job_hosts"),
            "--nodes", str(request.nodes), "--nproc", str(request.per_node),
            "--max-restarts", str(request.max_restarts), "--run-folder", ShellVar(RUN_FOLDER_VAR),
            "--stop-signal", request.stop_signal.name, "--job-id", ShellVar("LSB_JOBID"), "--", *rank_argv(request)]
    lines += [
        header_comment(request, "lsf"),
        "set -euo pipefail",
        'cd "$LS_SUBCWD"',
        *environment_block(request),
        "",
        *run_folder_lines(request, "LS_SUBCWD"),
        f'job_hosts="${RUN_FOLDER_VAR}/.job-hosts"',
        'awk \'NF && !seen[$0]++\' "$LSB_DJOB_HOSTFILE" >"$job_hosts"',
        'export MASTER_ADDR="$(head -n 1 "$job_hosts")"',
        'export MASTER_PORT="$(ddp-hpc port "$LSB_JOBID")"',
        deadline_line(request),
        "trap '' USR2 TERM",
        f"exec {render_argv(argv)}",
        "",
    ]
    return "\n".join(lines)


class LsfScheduler(Scheduler):
    name = "lsf"
    family = "lsf"
    script_suffix = ".lsf"
    launchers = ("openmpi",)

    def check_profile(self, request: SubmitRequest) -> None:
        super().check_profile(request)
        if (request.sweep is not None or request.chain != 1 or request.spare_nodes or request.stage_env
                or request.recover):
            raise UserError("the lsf family submits one job: no --sweep, --chain, --spare-nodes, --stage-env or "
                            "--recover")

    def dry_run(self, request: SubmitRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        self.check_profile(request)
        script_path = script_path or workdir / request.run_folder / f"job{self.script_suffix}"
        return DryRun(self.name, request, workdir, tuple(request.rank_command()), script=render_lsf(request),
                      script_path=script_path, submit_argv=("bsub",), script_on_stdin=True)

    def submit(self, dry_run: DryRun) -> Submission:
        write_script(dry_run.script, dry_run.script_path)
        if shutil.which("bsub") is None:
            raise UserError(f"bsub not found on PATH: the script is at {dry_run.script_path}; submit it where LSF "
                            f"runs: bsub < {dry_run.script_path}")
        with open(dry_run.script_path, "rb") as script:
            result = subprocess.run(list(dry_run.submit_argv), stdin=script, capture_output=True, text=True,
                                    cwd=dry_run.workdir, timeout=60)
        found = _SUBMITTED.search(result.stdout)
        if result.returncode != 0 or not found:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise UserError(f"bsub failed (exit {result.returncode}): {detail[0] if detail else 'no output'}")
        job_id = found.group(1)
        name = job_name_directive(dry_run.request.name)
        logs = [str(dry_run.workdir / f"{name}.{job_id}.{kind}") for kind in ("out", "err")]
        return self._submission(dry_run, [job_id], logs, (*dry_run.submit_argv, "<", str(dry_run.script_path)))

    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        code = read_exit_file(exit_file)
        if code is not None:
            return JobStatus(JobState.COMPLETED if code == 0 else JobState.FAILED, code, str(code), "exit file")
        out = query_tool(["bjobs", "-noheader", "-o", "stat", job_id])
        stat = (out or "").strip()
        if stat in _STATES:
            return JobStatus(_STATES[stat], None, stat, "bjobs")
        return JobStatus(JobState.UNKNOWN, None, "", "")

    def cancel_jobs(self, job_ids: Sequence[str]) -> None:
        run_tool(["bkill", *job_ids], "bkill cancels LSF jobs")

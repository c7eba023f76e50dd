"""The ``local`` family: the minimal example backend (docs/architecture.md) renders a bash
script and runs it on this machine; status, the exit file and the run folder work as for
the real schedulers."""

from __future__ import annotations

import json

import pytest

from conftest import ddp_hpc_command, run

pytestmark = [pytest.mark.multiproc]


def test_submit_local_runs_the_rendered_script_with_bash_and_waits_for_it(tmp_path):
    # One write per rank: under PYTHONUNBUFFERED a print of several pieces interleaves with the other rank's.
    command = ["python", "-c",
               "import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())"]
    result = run([*ddp_hpc_command(), "submit", "local", "--ranks-per-node", "2", "--run-dir", str(tmp_path),
                  "--job-name", "hello", "--wait", "--poll", "0.5", "--", *command], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    folder = tmp_path / "hello"
    script = (folder / "job.sh").read_text()
    # The script becomes the launch (exec): the one supervisor runs the attempts, and the
    # exit file carries the job id the submission recorded (the script's pid, which exec keeps).
    assert script.startswith("#!/bin/bash") and ('\nexec ddp-hpc launch --launcher local --nproc 2 --max-restarts 0 --run-folder '
                                                 '"${DDP_HPC_RUN_FOLDER}" -- ddp-hpc run -- python') in script
    submission = (folder / "submission.json").read_text()
    assert '"scheduler": "local"' in submission
    job_id = json.loads(submission)["job_id"]
    log = (folder / "job.log").read_text()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log, log
    exit_files = list(folder.glob("exit-*"))
    assert [f.name for f in exit_files] == [f"exit-{job_id}"] and exit_files[0].read_text().strip() == "0"
    status = run([*ddp_hpc_command(), "status", str(folder)], cwd=tmp_path)
    assert status.returncode == 0 and "completed" in status.stdout, status.stdout + status.stderr

"""The one exit-status contract of ``ddp-hpc launch`` (issue 30; docs/reliability.md), with a
loop written from docs/api.md (examples/resumable_loop.py, faults from
tests/scripts/own_loop_faults.py) under ``--max-restarts 2`` and each way the launch starts
its ranks: ddp-hpc itself with torchrun's variables (the default), MPICH, Open MPI, and
mpiexec over a ``--hostfile``.

- A stop (SIGUSR2 to a rank, or ahead of ``$DDP_HPC_DEADLINE``) ends the launch with 75, the
  first attempt's, restarted by nothing, before the deadline.
- A rank SIGKILLed mid-epoch is restarted; the restart resumes from the newest checkpoint
  (step 30, as each resumed rank says) and ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from conftest import ddp_hpc_command, run
from test_own_loop import EXAMPLE, FAULTS, assert_bit_identical, final_state, uninterrupted  # noqa: F401

pytestmark = [pytest.mark.reliability, pytest.mark.multiproc, pytest.mark.slow]

LAUNCHERS = ("local", "mpich", "openmpi", "hostfile")


def launch(launcher: str, tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """``ddp-hpc launch --max-restarts 2`` of the example, 2 ranks, with ``launcher``."""
    if launcher in ("mpich", "openmpi", "hostfile"):
        request.getfixturevalue("openmpi" if launcher == "openmpi" else "mpich")
    options = ["--launcher", launcher] if launcher != "hostfile" else []
    if launcher == "hostfile":
        hosts = tmp_path / "hosts"
        hosts.write_text(socket.gethostname() + "\n")
        options = ["--launcher", "mpich", "--hostfile", str(hosts), "--run-folder", str(tmp_path / "launch")]
    return [*ddp_hpc_command(), "launch", "--nproc", "2", "--max-restarts", "2", *options, "--",
            "python", FAULTS, EXAMPLE]


def attempts(stderr: str) -> int:
    """How many times rank 0 started: each start prints what it restored."""
    return len(re.findall(r"rank 0: restored ", stderr))


# A deadline stop is the ranks' own (StopAgreement), the same under every launcher; what a
# launcher adds, handing 75 back without a restart, the signal stops show for each. The
# deadline under the other launchers (about 40 s each, mostly waiting for it) is run by
# `scripts/test.sh -m acceptance`.
STOPS = [*(("signal", launcher) for launcher in LAUNCHERS), ("deadline", "local"),
         *(pytest.param("deadline", launcher, marks=pytest.mark.acceptance) for launcher in LAUNCHERS[1:])]


@pytest.mark.parametrize("stop, launcher", STOPS)
def test_a_stop_ends_the_launch_with_75_and_is_not_restarted(launcher, stop, tmp_path, request):
    """SIGUSR2 to rank 0 after step 30, or a deadline 70 s away (steps slowed to 1.2 s, 120 of
    them would take 144 s; margin 30 s, so the ranks stop about 40 s in, or at their first
    agreement step if starting them took longer; their exit after the stop takes up to 10 s):
    the ranks agree on a step, checkpoint and exit 75; the launch hands 75 back without
    starting them again."""
    deadline = int(time.time()) + 70
    env = {"RUN_DIR": str(tmp_path / "run"), "FAULT_MARKER": str(tmp_path / "signalled")}
    if stop == "signal":
        env["FAULT_SIGNAL_AT_STEP"] = "30"
    else:
        env.update({"DDP_HPC_DEADLINE": str(deadline), "FAULT_STEP_SLEEP": "1.2", "FAULT_DEADLINE_MARGIN": "30"})
    done = run(launch(launcher, tmp_path, request), timeout=300, env=env)
    ended = time.time()
    assert done.returncode == 75, done.stderr[-4000:]
    assert attempts(done.stderr) == 1, done.stderr[-4000:]
    assert "restart 1 of 2" not in done.stderr
    saved = final_state(tmp_path / "run")
    if stop == "signal":
        assert saved["step"] == 30 and "stopped on request at step 30" in done.stderr
    else:
        assert 0 < saved["step"] < 120
        assert ended < deadline, f"ended {ended - deadline:.1f} s past the deadline"


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_killed_rank_is_restarted_and_ends_bit_identical(launcher, tmp_path, request, uninterrupted):  # noqa: F811
    """Rank 1 SIGKILLs itself after step 35: the launch ends the other rank, starts both again,
    they say they resumed from step 30's checkpoint and finish as the uninterrupted run."""
    marker = tmp_path / "killed"
    done = run(launch(launcher, tmp_path, request), timeout=400, env={
        "RUN_DIR": str(tmp_path / "run"), "FAULT_KILL_RANK": "1", "FAULT_AT_STEP": "35", "FAULT_MARKER": str(marker)})
    assert done.returncode == 0, done.stderr[-6000:]
    assert marker.exists(), "rank 1 was not killed"
    assert attempts(done.stderr) == 2, done.stderr[-4000:]
    assert "restart 1 of 2" in done.stderr
    for rank in (0, 1):
        assert f"rank {rank}: restored None at step 0" in done.stderr
        assert re.search(rf"rank {rank}: restored \S+step-00000030\.pt at step 30", done.stderr), done.stderr[-3000:]
    assert_bit_identical(uninterrupted, final_state(tmp_path / "run"))

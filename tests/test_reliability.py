"""A dead, failing or stuck rank ends the whole job quickly, with a message that names it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST_WAIT, FIGURES, REPO, clean_env, ddp_hpc_command
from cpu_groups import CPU_CGROUP, alone_at_the_top, need_cpu_cgroups, remove_cgroups

pytestmark = [pytest.mark.multiproc, pytest.mark.reliability]
LIMIT_S = 60
TRAIN = ["train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=4096", "job.params.val_samples=0",
         "job.params.input_dim=32", "job.params.hidden=64", "job.params.depth=2", "training.batch_size=16",
         "training.epochs=5", "logging.progress=never", "logging.plot=false", "checkpoint.every_n_epochs=null"]


def fault(kind: str, marker: Path, rank: int = 1, step: int = 3) -> str:
    return (f"callbacks=[{{target: 'fault_injection:{kind}', "
            f"params: {{rank: {rank}, step: {step}, marker: '{marker}'}}}}]")


def launch_prefix(launcher: str, request) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--no-python"]
    if launcher == "srun":
        request.getfixturevalue("slurm_cluster")
        return ["srun", "-N2", "-n2", "--kill-on-bad-exit=1", "--wait=60"]
    program = request.getfixturevalue(launcher)
    return [program, "-n", "2", *(["--oversubscribe"] if launcher == "openmpi" else [])]


def run_faulty(prefix: list[str], tmp_path: Path, extra: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    marker = tmp_path / "fault-time"
    argv = [*prefix, *ddp_hpc_command(), *TRAIN, f"logging.run_dir={tmp_path / 'runs'}", *extra]
    env = clean_env({"PYTHONPATH": str(REPO / "tests")})
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    ended = time.time()
    assert marker.exists(), "the fault was never injected:\n" + result.stderr[-3000:]
    return result, ended - float(marker.read_text())


# What each launcher says about the rank that died first.
DEATH_MESSAGES = {
    "torchrun": r"host\s*:\s*\S+\s+rank\s*:\s*1 \(local_rank: 1\)\s+exitcode\s*:\s*-9",
    "openmpi": r"process rank 1 with PID \d+ on node \S+ exited on signal 9",
    # Hydra (MPICH 4.0.2) SIGKILLs the other ranks once one dies, then names ONE process
    # with a bad exit, not necessarily the one that died first: of 10 runs with rank 1
    # killed, it named rank 0 (which it had killed itself) in 8 and rank 1 in 2. So: its
    # block names a PID and host of this job (rank 0's start-up line lists them) and
    # exit code 9, whichever rank that is.
    "mpich": (r"ranks \(host:pid\): 0=(?P<host0>[^:\s]+):(?P<pid0>\d+) 1=(?P<host1>[^:\s]+):(?P<pid1>\d+)"
              r".*BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s+=\s+"
              r"PID (?:(?P=pid0) RUNNING AT (?P=host0)|(?P=pid1) RUNNING AT (?P=host1))\s+=\s+EXIT CODE: 9\s"),
    "srun": r"srun: error: n\d: task 1: Killed",
}


@pytest.mark.parametrize("launcher", list(DEATH_MESSAGES))
def test_a_sigkilled_rank_ends_the_job(launcher, request, tmp_path):
    result, seconds = run_faulty(launch_prefix(launcher, request), tmp_path,
                                 [fault("KillRankAtStep", tmp_path / "fault-time")])
    FIGURES.append(f"dead rank (SIGKILL) under {launcher}: job ended {seconds:.1f}s after the kill, "
                   f"exit {result.returncode}")
    assert result.returncode != 0
    assert seconds < LIMIT_S
    assert re.search(DEATH_MESSAGES[launcher], result.stderr + result.stdout, re.DOTALL), result.stderr[-3000:]


@pytest.mark.parametrize("launcher", ["torchrun", "mpich"])
def test_an_exception_on_one_rank_is_reported_with_rank_and_host(launcher, request, tmp_path):
    result, seconds = run_faulty(launch_prefix(launcher, request), tmp_path,
                                 [fault("RaiseOnRankAtStep", tmp_path / "fault-time")])
    FIGURES.append(f"exception on rank 1 under {launcher}: job ended {seconds:.1f}s after it, exit {result.returncode}")
    assert result.returncode != 0 and seconds < LIMIT_S
    assert re.search(r"\[rank 1\] ERROR ddp_hpc.training.run_on_rank: failed on host \S+ at epoch 1, step 3: "
                     r"RuntimeError: injected failure on rank 1", result.stderr), result.stderr[-3000:]


# docs/reliability.md: 12.9 s from the hang to the job's end with watchdog_s=8 (8 s, the
# 2.5-beat heartbeat check, the stacks, torchrun ending the other rank). The watchdog's own
# figure (the idle seconds it fired at) is held to its limit; the end to end time, which a
# loaded 2-core machine stretches, only to LIMIT_S. A watchdog that waited twice its limit fails.
WATCHDOG_S, WATCHDOG_LATE_S = 8, 4


def test_a_stuck_rank_is_detected_by_the_watchdog(request, tmp_path):
    """Rank 1 hangs in its own code after step 3: a watchdog ends the job within the
    documented time, exits with status 3 (docs/reliability.md) and rank 1 is named as the
    one out of step."""
    result, seconds = run_faulty(launch_prefix("torchrun", request), tmp_path,
                                 [fault("HangRankAtStep", tmp_path / "fault-time"), f"distributed.watchdog_s={WATCHDOG_S}"])
    FIGURES.append(f"stuck rank (watchdog {WATCHDOG_S}s) under torchrun: job ended {seconds:.1f}s after the hang, "
                   f"exit {result.returncode}")
    assert result.returncode != 0 and WATCHDOG_S < seconds < LIMIT_S, (seconds, result.stderr[-3000:])
    fired_at = [int(idle) for idle in re.findall(r"watchdog: no progress for (\d+)s", result.stderr)]
    assert fired_at and all(WATCHDOG_S <= idle <= WATCHDOG_S + WATCHDOG_LATE_S for idle in fired_at), fired_at
    # torchrun's summary of the first rank to fail: the watchdog's exit status.
    assert re.search(r"rank\s*:\s*[01] \(local_rank: [01]\)\s+exitcode\s*:\s*3 ", result.stderr), result.stderr[-3000:]
    assert re.search(r"\[rank \d\] watchdog: no progress for \d+s on host \S+ during training after step 3",
                     result.stderr), result.stderr[-3000:]
    assert "Stacks of every thread follow" in result.stderr and 'File "' in result.stderr
    # The hung rank's heartbeat still moves: nobody is gone (tests/test_multihost.py has a lost host).
    assert "watchdog: every rank's heartbeat still moves, so no rank is gone" in result.stderr
    # ddp-hpc train switched the flight recorder on: rank 1 sits in its own code after a
    # collective, rank 0 waits in the next one.
    behind = re.search(r"watchdog: collectives: out of step: rank 1 \(host \S+\) is past collective #(\d+) "
                       r"\(\w+.*\); every other rank is at collective #(\d+) ", result.stderr)
    assert behind and int(behind[2]) == int(behind[1]) + 1, result.stderr[-3000:]


SKIP_LOOP = str(REPO / "tests" / "scripts" / "skip_collective_loop.py")
SKIP_WATCHDOG_S = 6


@pytest.mark.parametrize("launcher", ["torchrun", "mpich", "srun"])
def test_a_rank_that_skips_an_all_reduce_is_named_with_the_collective_number(launcher, request, tmp_path):
    """3 ranks (a majority to compare with): rank 1 skips the all_reduce of step 3 of 6, so
    its final barrier meets the others' last all_reduce as collective #6; the watchdog
    (6 s) ends the job and names rank 1 there."""
    if launcher == "torchrun":
        prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "--no-python"]
    elif launcher == "srun":
        request.getfixturevalue("slurm_cluster")
        prefix = ["srun", "-N2", "-n3", "--kill-on-bad-exit=1", "--wait=60"]
    else:
        prefix = [request.getfixturevalue(launcher), "-n", "3"]
    marker = tmp_path / "skipped"
    env = clean_env({"SKIP_RANK": "1", "SKIP_STEP": "3", "WATCHDOG_S": str(SKIP_WATCHDOG_S),
                     "SKIP_MARKER": str(marker)})
    result = subprocess.run([*prefix, *ddp_hpc_command(), "run", "--", sys.executable, SKIP_LOOP],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    seconds = time.time() - float(marker.read_text())
    FIGURES.append(f"rank 1 skips an all_reduce under {launcher} (watchdog {SKIP_WATCHDOG_S}s): job ended "
                   f"{seconds:.1f}s after the skip, exit {result.returncode}")
    assert result.returncode != 0 and seconds < SKIP_WATCHDOG_S + 30, result.stderr[-3000:]
    # Any rank may fire first (all three stop beating within one step of each other) and the
    # launcher ends the rest: each rank reads the same statuses from the store, so each names rank 1.
    assert re.search(r"\[rank \d\] watchdog: collectives: out of step: rank 1 \(host \S+\) is at collective #6 "
                     r"\(barrier\); every other rank is at collective #6 \(all_reduce, 4\.0 KiB\)",
                     result.stderr), result.stderr[-3000:]


def run_capped(tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The job in a cgroup with the largest cpu.shares, rank 1 capped to 20% of one CPU in a
    child group; the result and when it started."""
    job = CPU_CGROUP / f"ddp-hpc-test-{os.getpid()}"
    job.mkdir()
    capped = job / "rank1"
    try:
        (job / "cpu.shares").write_text("262144")
        capped.mkdir()
        cap = (f"callbacks=[{{target: 'fault_injection:CapCpuOfRank', params: {{rank: 1, cgroup: '{capped}', "
               f"quota_us: 2000, period_us: 10000}}}}]")
        argv = [*launch_prefix("torchrun", None), *ddp_hpc_command(), "train",
                str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=19200", "job.params.val_samples=0",
                "training.epochs=1", "training.max_steps=150", "logging.progress=never", "logging.plot=false",
                "checkpoint.every_n_epochs=null",
                "distributed.watchdog_s=10", f"logging.run_dir={tmp_path / 'runs'}", "logging.name=capped", cap]
        started = time.time()
        # The shell joins the job's group, then becomes torchrun: the ranks start inside it.
        joined = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(job), *argv]
        job_run = subprocess.Popen(joined, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                   env=clean_env({"PYTHONPATH": str(REPO / "tests")}), start_new_session=True)
        try:
            stdout, stderr = job_run.communicate(timeout=300)
        finally:
            if job_run.poll() is None:
                os.killpg(job_run.pid, signal.SIGKILL)
                job_run.wait()
        result = subprocess.CompletedProcess(joined, job_run.returncode, stdout, stderr)
    finally:
        remove_cgroups(capped, job)
    return result, started


def test_a_rank_capped_to_20_percent_cpu_is_named_a_straggler_and_the_record_keeps_it(tmp_path):
    """Rank 1 capped by a cgroup v1 cpu quota to 20% of one CPU: rank 0 names it with its
    ratio within 150 steps (each rank's median forward time over its last 20 steps, sent with
    its heartbeat every second at watchdog_s=10: in two clean-clone CI runs, 50 steps ended
    before rank 0 had compared them); rank 0 itself, unperturbed, is not named. At 30% a
    clean-clone run once named nobody in 150 steps (the ratios seen here were 2.5-5.9, the
    bar 2.0); at 20% they were 6.7-8.8, named at step 15, 14 s a run.
    The whole job runs in a cgroup with the largest cpu.shares, so whatever else runs here
    (the other xdist worker) does not slow rank 0 too and hide the cap; rank 1's quota group
    is a child of it. A short period (10 ms) slows every forward pass alike."""
    need_cpu_cgroups()  # skipped only where DDP_HPC_REQUIRE_ALL allows it, as every other component
    with alone_at_the_top():
        result, started = run_capped(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    named = re.findall(r"straggler: rank (\d) \(host \S+\) takes ([\d.]+)x the median step time of the other "
                       r"ranks \([\d.e-]+s vs [\d.e-]+s of its own work a step, at step (\d+)\)", result.stderr)
    FIGURES.append(f"rank 1 capped to 20% of one CPU (torchrun, 2 ranks, 150 steps): named {named} "
                   f"in a run of {time.time() - started:.0f}s")
    assert [rank for rank, _, _ in named] == ["1"], result.stderr[-3000:]
    assert float(named[0][1]) >= 2.0 and int(named[0][2]) <= 150
    record = json.loads((tmp_path / "runs" / "capped" / "record" / "stragglers.json").read_text())
    assert [(found["rank"], found["step"] <= 150, found["ratio"] >= 2.0) for found in record] == [(1, True, True)]


@pytest.mark.mpi
def test_ranks_listen_on_loopback_only(tmp_path, mpich):
    """The rendezvous store and gloo bind the master/local address, never every interface."""
    record = f"callbacks=[{{target: 'fault_injection:RecordListeningSockets', params: {{folder: '{tmp_path}'}}}}]"
    argv = [mpich, "-n", "2", *ddp_hpc_command(), *TRAIN, "training.epochs=1", f"logging.run_dir={tmp_path / 'runs'}",
            record]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                            env=clean_env({"PYTHONPATH": str(REPO / "tests")}), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    addresses = {rank: (tmp_path / f"rank{rank}.txt").read_text().split() for rank in (0, 1)}
    assert addresses[0], "rank 0 serves the rendezvous store: it must listen somewhere"
    for rank, listening in addresses.items():
        assert all(a.startswith("127.") or a == "::1" for a in listening), (rank, listening)
    FIGURES.append(f"listening addresses of the ranks: {addresses}")


@pytest.mark.slurm
def test_a_dead_rank_fails_a_submitit_job_and_wait_reports_it(tmp_path, slurm_cluster):
    marker = tmp_path / "fault-time"
    argv = [*ddp_hpc_command(), "submit", "slurm", str(REPO / "configs" / "synthetic.yaml"), "--nodes", "1",
            "--tasks-per-node", "2", "--walltime", "10", *FAST_WAIT, *TRAIN[2:], f"logging.run_dir={tmp_path / 'runs'}",
            fault("KillRankAtStep", marker)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=clean_env({"PYTHONPATH": str(REPO / "tests")}))
    ended = time.time()
    assert marker.exists(), result.stderr[-3000:]
    seconds = ended - float(marker.read_text())
    FIGURES.append(f"dead rank (SIGKILL) under submitit: submit --wait returned {seconds:.1f}s after the kill, "
                   f"exit {result.returncode}")
    assert result.returncode == 1 and seconds < LIMIT_S
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    assert re.search(rf"ddp-hpc: error: job {job_id} failed: rank\(s\) 1 ended without a result \(killed",
                     result.stderr), result.stderr[-2000:]
    state = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-o", "State"], capture_output=True, text=True).stdout
    assert "FAILED" in state

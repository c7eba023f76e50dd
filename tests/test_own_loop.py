"""examples/resumable_loop.py as a user runs it, on real launchers (issue 18's acceptance):
killed or stopped mid-epoch, it ends bit-identical to an uninterrupted run, and resumed on
another world size it trains every sample of the interrupted epoch once.

Faults are injected by tests/scripts/own_loop_faults.py right after a step of the loop."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import FIGURES, REPO, assert_same_model_and_optimizer, built_once, clean_env, ddp_hpc_command, run
from ddp_hpc.engine.checkpoint.files import load_checkpoint, load_rank_part

pytestmark = [pytest.mark.reliability, pytest.mark.multiproc, pytest.mark.slow]

EXAMPLE = str(REPO / "examples" / "resumable_loop.py")
FSDP2_EXAMPLE = str(REPO / "examples" / "fsdp2_loop.py")
FAULTS = str(REPO / "tests" / "scripts" / "own_loop_faults.py")
STEPS = 5 * 24  # 5 epochs of ceil(750 / 32) steps on 2 ranks
# 2 ranks to step 30, 3 ranks to 50 (epoch 1's rest: 12 steps; 8 of epoch 2), then 1 rank:
# epoch 2's rest (1500 - 8 * 96 = 732 samples: 23 steps) and 2 epochs of 47 steps.
STEPS_1_RANK = 50 + 23 + 2 * 47


def torchrun(nproc: int, *args: str, max_restarts: int = 0, example: str = EXAMPLE) -> list[str]:
    return ["torchrun", "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
            FAULTS, example, *args]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The reference: one uninterrupted 2-rank run's final checkpoint (one run for all workers)."""
    def build(folder: Path) -> None:
        done = run(torchrun(2), env={"RUN_DIR": str(folder)}, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]

    return final_state(built_once(tmp_path_factory, "own-loop-whole", build))


def final_state(folder: Path) -> dict:
    """The last checkpoint, with each rank's part (its own file beside it) as ``ranks``."""
    state = load_checkpoint(folder / "checkpoints" / "last.pt")
    state["ranks"] = [load_rank_part(folder / "checkpoints", state["step"], rank) for rank in range(state["world_size"])]
    return state


def assert_bit_identical(expected: dict, actual: dict) -> None:
    assert actual["step"] == expected["step"] == STEPS
    assert actual["sampler"] == expected["sampler"]
    assert_same_model_and_optimizer(expected, actual)
    # The example seeds torch's RNG only: numpy's and Python's start from OS entropy in every
    # process, so only torch's stream can (and must) be the same as in the uninterrupted run.
    assert len(actual["ranks"]) == len(expected["ranks"]) == 2
    for mine, theirs in zip(actual["ranks"], expected["ranks"]):
        assert torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"])


def test_torchrun_rank_0_killed_half_way_through_a_checkpoint_write_restarts_bit_identical(tmp_path, uninterrupted):
    """``torchrun --max-restarts 1`` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/api.md):
    rank 0 SIGKILLs itself inside the (synchronous) write of step 20's checkpoint, with part
    of the file's bytes in its temporary, while rank 1 waits for it in the next step's
    collective; the agent stops rank 1 (SIGTERM, which the example's handler turns into a
    stop request) and starts both again; they resume from step 10, never from the
    half-written file, whose temporary the restart removes, and end as the uninterrupted
    run does. (Rank 1 SIGKILLed after a step, under each launcher: tests/test_launch_contract.py.)

    Why the variable: torch's DynamicRendezvousHandler (elastic/rendezvous/
    dynamic_rendezvous.py: use_agent_store, _shared_tcp_store_server) creates the TCPStore
    that workers use once per agent and hands the same one to every attempt, and
    rendezvous.py's _create_c10d_store connects env:// workers to it without a prefix per
    attempt, so attempt 1 read attempt 0's gloo addresses (connectFullMesh: connection
    refused). Set to "1", rank 0 of each attempt hosts a new store instead."""
    kill_log = tmp_path / "kills"
    done = run(torchrun(2, max_restarts=1), timeout=300, env={
        "RUN_DIR": str(tmp_path / "run"), "FAULT_SAVE_KILLS": "1", "FAULT_SAVE_KILL_SYNC": "1",
        "FAULT_SAVE_KILL_LOG": str(kill_log), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert done.returncode == 0, done.stderr[-6000:]
    [(step, temporary, written, size)] = [line.split() for line in kill_log.read_text().splitlines()]
    assert step == "20" and re.fullmatch(r"\.step-00000020\.pt\.tmp-\S+", Path(temporary).name), temporary
    assert 0 < int(written) < int(size)  # the kill left a half-written temporary
    for rank in (0, 1):
        assert _restores(done.stderr, rank) == [None, 10], done.stderr[-3000:]
    assert not Path(temporary).exists() and not list((tmp_path / "run" / "checkpoints").glob(".*.tmp-*"))
    assert_bit_identical(uninterrupted, final_state(tmp_path / "run"))


def _ids(folder: Path) -> Counter:
    counts: Counter = Counter()
    for path in folder.glob("rank-*.txt"):
        counts.update(tuple(map(int, line.split())) for line in path.read_text().splitlines())
    return counts


def test_stopped_mid_epoch_on_2_ranks_resumed_on_3_trains_every_sample_once(tmp_path):
    """SIGUSR2 to rank 1 alone after step 30 (epoch 2, 6 steps in): every rank stops at the
    same step with a checkpoint and exits 75 (a stop any rank requested, not only rank 0);
    3 ranks then finish the run."""
    first, second = tmp_path / "ids-2", tmp_path / "ids-3"
    first.mkdir(), second.mkdir()
    env = {"RUN_DIR": str(tmp_path / "run"), "FAULT_SIGNAL_AT_STEP": "30", "FAULT_SIGNAL_RANK": "1",
           "FAULT_MARKER": str(tmp_path / "sent")}
    stopped = run(torchrun(2), timeout=240, env={**env, "RECORD_IDS": str(first)})
    assert stopped.returncode != 0 and re.search(r"exitcode\s*:\s*75", stopped.stderr), stopped.stderr[-3000:]
    assert "stopped on request at step 30" in stopped.stderr
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert saved["step"] == 30 and saved["sampler"]["epoch"] == 1 and saved["sampler"]["batches_done"] == 6

    resumed = run(torchrun(3), timeout=240, env={**env, "RECORD_IDS": str(second)})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after = _ids(first), _ids(second)
    interrupted = Counter({sample: n for (epoch, sample), n in (before + after).items() if epoch == 1})
    assert sorted(interrupted) == list(range(1500)) and set(interrupted.values()) == {1}
    assert sum(n for (epoch, _), n in before.items() if epoch == 1) == 6 * 32 * 2
    for epoch in (2, 3, 4):  # whole epochs on 3 ranks: 500 samples each, no padding
        assert Counter(sample for (e, sample), n in after.items() if e == epoch for _ in range(n)) \
            == Counter(range(1500))
    final = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert final["world_size"] == 3 and final["sampler"]["epoch"] == 5
    # The learning-rate schedule was planned after the restore for the steps 3 ranks had left
    # (docs/api.md): 30 + 12 (epoch 1's rest) + 3 x 16, and it ended with the run.
    assert final["step"] == 90
    assert final["optimizer"]["param_groups"][0]["lr"] == one_cycle_lr_at_end(90)


def one_cycle_lr_at_end(total_steps: int) -> float:
    """The example's OneCycleLR after all of its ``total_steps`` steps."""
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=total_steps)
    for _ in range(total_steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


def _dcp_whole(path: Path) -> dict:
    """A dcp checkpoint folder as one dict, optimizer state keyed like the file format's
    (parameter index)."""
    from ddp_hpc.engine.checkpoint.dcp_read import read_whole

    state = read_whole(path)
    names = state["optimizer"]["param_groups"][0]["params"]
    state["optimizer"]["state"] = {names.index(name): value for name, value in state["optimizer"]["state"].items()}
    return state


def _dcp_final_state(folder: Path) -> dict:
    """The newest dcp checkpoint as one dict, optimizer state keyed like the file format's
    (parameter index), with each rank's part as ``ranks``."""
    from ddp_hpc.engine.checkpoint.dcp_read import SHARED_KEY, check_complete, rank_key, read_blob, read_whole

    checkpoints = folder / "checkpoints"
    path = checkpoints / (checkpoints / "last.dcp").read_text().strip()
    state = read_whole(path)
    names = state["optimizer"]["param_groups"][0]["params"]
    state["optimizer"]["state"] = {names.index(name): value for name, value in state["optimizer"]["state"].items()}
    metadata = check_complete(path)
    assert read_blob(path, metadata, SHARED_KEY)["world_size"] == 2
    state["ranks"] = [read_blob(path, metadata, rank_key(rank)) for rank in range(2)]
    return state


@pytest.fixture(scope="module")
def uninterrupted_fsdp2(tmp_path_factory) -> dict:
    """examples/fsdp2_loop.py uninterrupted on 2 ranks (dcp checkpoints every 10 steps): its
    final checkpoint."""
    folder = tmp_path_factory.mktemp("whole-fsdp2")
    done = run(torchrun(2, example=FSDP2_EXAMPLE), env={"RUN_DIR": str(folder)}, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return _dcp_final_state(folder)


@pytest.mark.acceptance
@pytest.mark.timeout(1500)  # 21 attempts of a 2-rank launch: 15 minutes on a heavily loaded 2-core machine
def test_twenty_random_sigkills_of_an_fsdp2_run_with_dcp_checkpoints_every_step_end_bit_identical(
        tmp_path, uninterrupted_fsdp2):
    """One ``torchrun --max-restarts 20`` launch of examples/fsdp2_loop.py (the model and
    Adam's state sharded by ``fully_shard``) with dcp checkpoints every step; in each of the
    first 20 attempts one rank SIGKILLs itself (tests/scripts/own_loop_faults.py,
    FAULT_KILLS): two in three while its shard file of a checkpoint is partly written and
    flushed, the others right after a step. Each kill records what it saw on disk: the
    shard's size, whether the checkpoint's metadata existed, the newest complete step.
    Every attempt resumes from the newest complete checkpoint at the kill, and the run ends
    as the uninterrupted fsdp2 run does, bit for bit."""
    log = tmp_path / "kills.jsonl"
    done = run(torchrun(2, max_restarts=20, example=FSDP2_EXAMPLE), timeout=900, env={
        "RUN_DIR": str(tmp_path / "run"), "CHECKPOINT_EVERY": "1", "FAULT_KILLS": "20",
        "FAULT_SEED": "19", "FAULT_LOG": str(log), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert done.returncode == 0, done.stderr[-6000:]
    held = [(int(mine), int(whole)) for mine, whole in re.findall(r"holds (\d+) of (\d+) parameters", done.stdout)]
    assert len(held) == 2 and all(mine < whole for mine, whole in held), done.stdout  # sharded, not replicated
    kills = [json.loads(line) for line in log.read_text().splitlines()]
    assert [k["attempt"] for k in kills] == list(range(20))
    mid_write = [k for k in kills if k["mode"] == "mid-write"]
    assert len(mid_write) >= 13
    for kill in mid_write:  # observed at the kill: the shard on disk in part, no metadata yet
        assert not kill["metadata_exists"] and 0 < kill["shard_bytes"], kill
        if kill.get("complete_shard_bytes"):
            assert kill["shard_bytes"] < kill["complete_shard_bytes"], kill
    restored = {rank: [int(step) for step in re.findall(rf"rank {rank}: restored \S+ at step (\d+)", done.stderr)]
                for rank in (0, 1)}
    expected = [0] + [k["newest_complete_step"] or 0 for k in kills]
    assert restored[0] == restored[1] == expected, (restored, expected)
    assert_bit_identical(uninterrupted_fsdp2, _dcp_final_state(tmp_path / "run"))
    FIGURES.append(f"fsdp2 dcp kills: {len(mid_write)} of 20 SIGKILLs inside a shard write (sizes "
                   f"{sorted(k['shard_bytes'] for k in mid_write)[:3]}... bytes, no metadata); all resumed")


def test_dcp_stopped_on_2_ranks_resumed_on_3_then_on_1_trains_every_sample_once_then_inspect_and_convert(tmp_path):
    """dcp checkpoints: SIGUSR2 stops 2 ranks at step 30 (epoch 1, 6 steps in), 3 ranks
    resume from that folder (the model and optimizer resharded) and are stopped at step 50
    (epoch 2, 8 steps in), 1 rank finishes. Every sample of each interrupted epoch is
    trained once. Each resumed rank starts with exactly the weights and Adam moments the
    checkpoint holds. Then ``ddp-hpc checkpoint inspect`` and ``convert`` as a user runs them."""
    folders = [tmp_path / f"ids-{n}" for n in (2, 3, 1)]
    for folder in [*folders, tmp_path / "restored"]:
        folder.mkdir()
    base = {"RUN_DIR": str(tmp_path / "run"), "CHECKPOINT_FORMAT": "dcp", "RECORD_RESTORED": str(tmp_path / "restored")}
    checkpoints = tmp_path / "run" / "checkpoints"
    first = run(torchrun(2), timeout=240, env={**base, "RECORD_IDS": str(folders[0]), "FAULT_SIGNAL_AT_STEP": "30",
                                               "FAULT_MARKER": str(tmp_path / "sent-1")})
    assert re.search(r"exitcode\s*:\s*75", first.stderr), first.stderr[-3000:]
    at_30 = _dcp_whole(checkpoints / "step-00000030")
    second = run(torchrun(3), timeout=240, env={**base, "RECORD_IDS": str(folders[1]), "FAULT_SIGNAL_AT_STEP": "50",
                                                "FAULT_MARKER": str(tmp_path / "sent-2")})
    assert re.search(r"exitcode\s*:\s*75", second.stderr), second.stderr[-3000:]
    assert re.search(r"rank 2: restored \S+step-00000030 at step 30", second.stderr), second.stderr[-3000:]
    at_50 = _dcp_whole(checkpoints / "step-00000050")
    third = run(torchrun(1), timeout=240, env={**base, "RECORD_IDS": str(folders[2])})
    assert third.returncode == 0, third.stderr[-3000:]
    assert "rank 0: restored" in third.stderr and "step-00000050 at step 50" in third.stderr
    for world, saved in ((3, at_30), (1, at_50)):
        for rank in range(world):
            held = torch.load(tmp_path / "restored" / f"restored-{world}-{rank}.pt", weights_only=True)
            assert int(saved["optimizer"]["state"][0]["step"]) == (30 if world == 3 else 50)
            assert_same_model_and_optimizer(saved, held)
            assert sorted(held["optimizer"]["state"]) == sorted(saved["optimizer"]["state"])

    ids = [_ids(folder) for folder in folders]
    for epoch, parts in ((1, ids[:2]), (2, ids[1:])):
        interrupted = Counter({sample: n for part in parts for (e, sample), n in part.items() if e == epoch})
        assert sorted(interrupted) == list(range(1500)) and set(interrupted.values()) == {1}, epoch
    assert sum(n for (e, _), n in ids[0].items() if e == 1) == 6 * 32 * 2
    assert sum(n for (e, _), n in ids[1].items() if e == 2) == 8 * 32 * 3
    for epoch in (3, 4):
        assert Counter(sample for (e, sample), n in ids[2].items() if e == epoch for _ in range(n)) == Counter(range(1500))

    shown = run([*ddp_hpc_command(), "checkpoint", "inspect", str(tmp_path / "run"), "--json"], timeout=120)
    assert shown.returncode == 0, shown.stderr
    table = json.loads(shown.stdout)
    assert [(row["format"], row["complete"], row["world_size"]) for row in table] == [("dcp", True, 1)] * 3
    assert table[-1]["step"] == STEPS_1_RANK and table[-1]["size_bytes"] > 0
    converted = run([*ddp_hpc_command(), "checkpoint", "convert", str(tmp_path / "run"), str(tmp_path / "model.pt")],
                    timeout=120)
    assert converted.returncode == 0, converted.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model.load_state_dict(state["model"])  # for inference: no process group, no module. prefix
    assert state["step"] == STEPS_1_RANK and state["sampler"]["epoch"] == 5 and state["sampler"]["world_size"] == 1
def _requeued_and_released(job_id: str) -> None:
    """Wait for the requeue, then start the job now rather than after Slurm's requeue delay.
    Not ``test_preemption.release_requeued``, which first waits for idle nodes: other jobs
    may hold them, and by then the job may have started by itself (the update then fails)."""
    from test_preemption import job_state, wait_for

    wait_for(lambda: "PENDING" in job_state(job_id), 120, "the requeue")
    time.sleep(2.0)  # the revoked credential must be over a second old (slurmd's 1-second resolution)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)


def _restores(log: str, rank: int = 0) -> list[str]:
    """What each attempt of ``rank`` restored, in order: a step number, or None."""
    found = re.findall(rf"rank {rank}: restored (\S+) at step (\d+)", log)
    return [None if path == "None" else int(step) for path, step in found]


@pytest.mark.slurm
@pytest.mark.timeout(900)  # three launches and a requeue: 4-5 minutes on the loaded 2-core machine
def test_sbatch_job_killed_once_then_signalled_requeues_and_ends_bit_identical(tmp_path, uninterrupted, slurm_cluster):
    """ONE rendered sbatch job (``--max-restarts 1``): rank 1 SIGKILLs itself after step 35,
    the script restarts both ranks in the allocation (resume from step 30); later the batch
    shell gets SIGUSR2 as from ``--signal`` (``scancel --signal=USR2 --batch``), the ranks
    stop at an agreed step with a checkpoint, the script requeues the job, and the requeued
    job finishes bit-identical to the uninterrupted run."""
    from test_preemption import wait_for

    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    submit = subprocess.Popen(
        [*ddp_hpc_command(), "submit", "slurm", "--sbatch", "--nodes", "1", "--tasks-per-node", "2",
         "--max-restarts", "1", "--walltime", "20", "--job-name", "own-loop", "--run-dir", str(tmp_path / "runs"),
         "--wait", "--", "python", FAULTS, EXAMPLE],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env({"RUN_DIR": str(run_dir), "FAULT_KILL_RANK": "1", "FAULT_AT_STEP": "35",
                       "FAULT_MARKER": str(marker), "FAULT_STEP_SLEEP": "0.1"}))
    job_id = re.search(r"submitted job (\d+)", submit.stdout.readline()).group(1)
    try:
        # Signal once the restarted ranks have checkpointed past the kill.
        wait_for(lambda: marker.exists() and (run_dir / "checkpoints" / "step-00000050.pt").exists(), 240,
                 "the restarted ranks' checkpoint at step 50")
        subprocess.run(["scancel", "--signal=USR2", "--batch", job_id], check=True)
        _requeued_and_released(job_id)
        out, err = submit.communicate(timeout=300)
    finally:  # a failed test leaves no job behind (a requeued one would wait for ever)
        subprocess.run(["scancel", job_id], capture_output=True)
    assert submit.returncode == 0, out[-2000:] + err[-3000:]
    log = next((tmp_path / "logs").glob(f"own-loop-{job_id}.out")).read_text()
    assert "restart 1 of 1" in log and "requeueing job" in log, log[-3000:]
    stopped = int(re.search(r"stopped on request at step (\d+)", log).group(1))
    # The first attempt, the restart after the kill, the requeued job after the stop.
    assert _restores(log) == _restores(log, rank=1) == [None, 30, stopped], log[-3000:]
    assert stopped >= 50
    assert_bit_identical(uninterrupted, final_state(run_dir))


@pytest.mark.slurm
@pytest.mark.timeout(900)  # two launches and a requeue: about 5 minutes on the loaded 2-core machine
def test_submitit_command_job_signalled_requeues_and_ends_bit_identical(tmp_path, uninterrupted, slurm_cluster):
    """The example as a submitit command job: SIGUSR2 to the tasks (what submitit's
    ``--signal=USR2@90`` sends), the ranks checkpoint at an agreed step and exit 75, the job
    is requeued and finishes bit-identical."""
    from test_preemption import wait_for

    run_dir = tmp_path / "run"
    submit = subprocess.Popen(
        [*ddp_hpc_command(), "submit", "slurm", "--nodes", "1", "--tasks-per-node", "2", "--walltime", "20",
         "--job-name", "own-loop", "--run-dir", str(tmp_path / "runs"), "--wait", "--", "python", FAULTS, EXAMPLE],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env({"RUN_DIR": str(run_dir), "FAULT_STEP_SLEEP": "0.1"}))
    job_id = re.search(r"submitted job (\d+)", submit.stdout.readline()).group(1)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step-00000030.pt").exists(), 240, "the checkpoint at step 30")
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        _requeued_and_released(job_id)
        out, err = submit.communicate(timeout=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    assert submit.returncode == 0, out[-2000:] + err[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / "own-loop" / "submitit").glob("*_0_log.err"))
    stopped = int(re.search(r"stopped on request at step (\d+)", logs).group(1))
    assert _restores(logs) == [None, stopped] and stopped >= 30, logs[-3000:]
    assert_bit_identical(uninterrupted, final_state(run_dir))


@pytest.mark.acceptance
@pytest.mark.slurm
@pytest.mark.timeout(900)  # 2 links on a quiet machine, up to 8 when start-up takes 40 s of each minute
def test_pbs_chain_of_short_jobs_stops_at_each_deadline_and_ends_bit_identical(tmp_path, uninterrupted, qsub):
    """qsub --chain 8 of 1-minute jobs, no signal at all: a link's ranks stop ahead of
    $DDP_HPC_DEADLINE (margin 5 s) at an agreed step with a checkpoint (exit 75), the next
    link resumes, links that find the run finished train nothing. 120 steps of at least
    0.4 s are longer than one link leaves after start-up on a quiet machine (about 47 s);
    loaded by other jobs, start-up took 40 s of each minute here, hence 8 links."""
    run_dir = tmp_path / "run"
    result = run([*ddp_hpc_command(), "submit", "pbs", "--cluster", "pbs-generic", "--nodes", "1",
                  "--ranks-per-node", "2", "--walltime", "1", "--chain", "8", "--job-name", "own-chain",
                  "--run-dir", str(tmp_path / "runs"), "--wait", "--", "python", FAULTS, EXAMPLE],
                 cwd=tmp_path, timeout=840,
                 env={"RUN_DIR": str(run_dir), "FAULT_STEP_SLEEP": "0.4", "FAULT_DEADLINE_MARGIN": "5"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The ranks' stderr, link after link (job.pbs.e<job id>).
    logs = "".join(path.read_text() for path in sorted(tmp_path.glob("job.pbs.e*"), key=lambda p: int(p.suffix[2:])))
    stops = [int(step) for step in re.findall(r"stopped ahead of the job deadline at step (\d+)", logs)]
    assert stops, logs[-3000:]  # at least one link stopped itself before its walltime
    assert _restores(logs)[:len(stops) + 1] == [None, *stops]
    assert_bit_identical(uninterrupted, final_state(run_dir))


@pytest.mark.acceptance
@pytest.mark.timeout(1200)  # 11 launches of 2 ranks: over 5 minutes on the loaded 2-core machine
def test_rank_0_killed_10_times_during_background_saves_resumes_each_time_from_the_previous_checkpoint(
        tmp_path, uninterrupted):
    """``torchrun --max-restarts 10``; checkpoints every 10 steps, in the background. Kill k
    (k = 0..9) hits rank 0 while its writer thread is writing the checkpoint of step
    10 (k + 2), at a random byte. Each restart resumes from the previous checkpoint (step
    10 (k + 1), whole), never an older one, and the run ends bit-identical."""
    kill_log = tmp_path / "kills"
    done = run(torchrun(2, max_restarts=10), timeout=900, env={
        "RUN_DIR": str(tmp_path / "run"), "FAULT_SAVE_KILLS": "10", "FAULT_SAVE_KILL_LOG": str(kill_log),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert done.returncode == 0, done.stderr[-6000:]
    kills = [line.split() for line in kill_log.read_text().splitlines()]
    assert [int(step) for step, *_ in kills] == list(range(20, 120, 10))
    for step, temporary, written, size in kills:  # each kill hit a half-written temporary file
        assert re.fullmatch(rf"\.step-{int(step):08d}\.pt\.tmp-\S+", Path(temporary).name), temporary
        assert 0 < int(written) < int(size)
    assert len({int(w) / int(s) for _, _, w, s in kills}) == 10  # random points
    assert _restores(done.stderr) == [None, *range(10, 110, 10)], done.stderr[-3000:]
    assert not list((tmp_path / "run" / "checkpoints").glob(".*.tmp-*"))  # the restarts removed the leftovers
    assert_bit_identical(uninterrupted, final_state(tmp_path / "run"))

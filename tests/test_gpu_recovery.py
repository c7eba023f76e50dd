"""In-job recovery with ranks on a GPU (``pytest -m gpu``, ``-m gpu2``).

Over gloo, which runs DDP's all-reduce on CUDA tensors, several ranks share one GPU. Over
NCCL (one GPU per rank) a broken group is aborted and formed anew: on one GPU a one-rank
group aborted mid-step in its own process, on two GPUs the whole recovery of a killed rank.
Skipped without the devices (.ci/run deselects them); the CPU dry run of the one-rank case
is tests/test_in_job_recovery_parts.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_model_and_optimizer, clean_env, ddp_hpc_command
from test_in_job_recovery import (EXAMPLE, LAUNCH_TIMEOUT_S, RANKS, LOST, SETTINGS, final, finish, launch,
                                  lose_a_rank, recovery_record, steps)
from test_in_job_recovery_parts import assert_the_aborted_step_was_redone_bit_identical

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: "
                                 f"torch.cuda.is_available() is False here (torch {torch.__version__})")]
#: Deterministic cuBLAS, so that a step redone after the recovery sums as the first time did.
ON_CUDA = {"DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_a_killed_rank_on_the_gpu_is_replaced_and_the_run_ends_bit_identical(tmp_path):
    """examples/recovering_loop.py with 4 ranks on cuda (one GPU shared over gloo) under
    ``launch --recover 1``; rank 2 SIGKILLed after 3 steps: replaced, the others keep their
    processes, every rank's model, optimizer state (on the GPU) and streams (CUDA's too)
    end as in the same run without a loss."""
    reference_dir = tmp_path / "reference"
    finish(launch(reference_dir, "--recover", "1", settings=ON_CUDA))
    pids, _, _ = lose_a_rank(tmp_path / "lost", signal.SIGKILL, settings=ON_CUDA)
    record = recovery_record(tmp_path / "lost")
    assert record["rank"] == LOST and record["replaced"]
    for slot in range(RANKS):
        reference, state = final(reference_dir, slot), final(tmp_path / "lost", slot)
        assert (state["pid"] != pids[slot]) if slot == LOST else (state["pid"] == pids[slot])
        assert next(iter(state["model"].values())).is_cuda
        assert_same_model_and_optimizer(reference, state)
        assert torch.equal(torch.stack(reference["rng"]["cuda"]), torch.stack(state["rng"]["cuda"]))
        assert state["resumed"] is None


def test_a_one_rank_nccl_group_aborted_mid_step_is_formed_anew_in_its_process_and_ends_bit_identical(tmp_path):
    """One rank, ``InJobRecovery("nccl")`` on cuda:0 (the group made with ``device_id``): the
    test publishes the launch's next plan in step 3; the rank's heartbeat aborts the NCCL
    group (``ProcessGroup.abort``), the fence refuses that step, the rank lets the aborted
    group go and forms the next one in the same process (state sent over NCCL on the GPU),
    and the run ends bit-identical to the same run without the plan."""
    if not torch.distributed.is_nccl_available():
        pytest.skip(f"this torch ({torch.__version__}) has no NCCL")
    assert_the_aborted_step_was_redone_bit_identical("nccl", tmp_path)


#: Two ranks, one GPU each, NCCL; deterministic cuBLAS so that a redone step sums as before.
ON_TWO_GPUS = {"DEVICE": "cuda", "BACKEND": "nccl", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def launch_two(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([*ddp_hpc_command(), "launch", "--nproc", "2", "--recover", "1", "--", "python", EXAMPLE],
                            env=clean_env({**SETTINGS, **ON_TWO_GPUS, "RUN_DIR": str(run_dir)}), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.gpu2
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs two CUDA devices, this host has {torch.cuda.device_count()}")
def test_a_killed_rank_of_an_nccl_group_on_two_gpus_is_replaced_and_the_run_ends_bit_identical(tmp_path):
    """examples/recovering_loop.py over NCCL, rank 0 on cuda:0 and rank 1 on cuda:1, under
    ``launch --recover 1``; rank 1 SIGKILLed after 3 steps: rank 0 aborts the group and keeps
    its process, the replacement takes cuda:1, and both end as in the same run without a loss
    (model, optimizer state, CUDA streams)."""
    reference_dir, lost_dir = tmp_path / "reference", tmp_path / "lost"
    finish(launch_two(reference_dir))
    process = launch_two(lost_dir)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while len(steps(lost_dir, 1)) < 3:
        assert process.poll() is None, process.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "rank 1 never completed 3 steps"
        time.sleep(0.1)
    pids = {slot: steps(lost_dir, slot)[-1][0] for slot in (0, 1)}
    os.kill(pids[1], signal.SIGKILL)
    finish(process)
    record = recovery_record(lost_dir)
    assert record["rank"] == 1 and record["replaced"] and record["world_size"] == 2
    for slot in (0, 1):
        reference, state = final(reference_dir, slot), final(lost_dir, slot)
        assert (state["pid"] != pids[slot]) if slot == 1 else (state["pid"] == pids[slot])
        assert next(iter(state["model"].values())).device == torch.device("cuda", slot)
        assert_same_model_and_optimizer(reference, state)
        assert torch.equal(torch.stack(reference["rng"]["cuda"]), torch.stack(state["rng"]["cuda"]))
        assert state["resumed"] is None


@pytest.mark.gpu2
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs two CUDA devices, this host has {torch.cuda.device_count()}")
def test_a_killed_rank_of_an_fsdp2_model_over_nccl_on_two_gpus_comes_back_from_its_buddys_snapshot(tmp_path):
    """examples/sharded_recovering_loop.py over NCCL, one GPU per rank, ``launch --recover 1``;
    rank 1 dies before its backward of step 5 (tests/scripts/recovery_faults: rank 0's
    reduce-scatter then waits on the GPU for a peer that is gone): rank 0 aborts the group,
    the fence refuses that step, FSDP2 is pointed at the new group, the replacement takes
    its shards from rank 0's copy of its snapshot, and both ranks' shards and optimizer
    state end as in the same run without a loss."""
    example = str(REPO / "examples" / "sharded_recovering_loop.py")
    settings = {"EPOCHS": "1", "STEP_DELAY_S": "0.2", "BACKEND": "nccl", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                "DDP_HPC_SNAPSHOT_DIR": str(tmp_path / "node-memory")}

    def start(run_dir: Path) -> subprocess.Popen:
        return subprocess.Popen([*ddp_hpc_command(), "launch", "--nproc", "2", "--recover", "1", "--", "python",
                                 example], env=clean_env({**settings, "RUN_DIR": str(run_dir)}), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    reference_dir, lost_dir = tmp_path / "reference", tmp_path / "lost"
    finish(start(reference_dir))
    settings.update({"PYTHONPATH": str(REPO / "tests" / "scripts" / "recovery_faults"), "RECOVERY_FAULT": "backward",
                     "RECOVERY_FAULT_SLOT": "1", "RECOVERY_FAULT_STEP": "5"})
    output = finish(start(lost_dir))
    assert "rank 1 lost" in output, output[-4000:]
    record = recovery_record(lost_dir)
    assert record["rank"] == 1 and record["replaced"] and record["snapshot_step"] is not None
    for slot in (0, 1):
        reference, state = final(reference_dir, slot), final(lost_dir, slot)
        assert state["resumed"] is None
        assert_same_model_and_optimizer(reference, state)

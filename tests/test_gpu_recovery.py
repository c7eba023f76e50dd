"""In-job recovery with ranks on a GPU (``pytest -m gpu``): the group is gloo, the only
backend in-job recovery runs over, and gloo runs DDP's all-reduce on CUDA tensors, so
several ranks share one GPU. Skipped without a CUDA device (.ci/run deselects them)."""

from __future__ import annotations

import signal

import pytest
import torch

from conftest import assert_same_model_and_optimizer
from test_in_job_recovery import RANKS, LOST, final, finish, launch, lose_a_rank, recovery_record

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

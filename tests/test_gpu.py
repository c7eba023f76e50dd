"""The GPU paths, run for real where there is a CUDA device (``pytest -m gpu``).

On a host without one every test here skips with that reason; ``pytest -m gpu
--collect-only`` lists them anywhere. Nothing here fakes a device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_training_state, ddp_hpc_command, run
from ddp_hpc.config import load_config
from ddp_hpc.distributed import DistributedOptions, process_group
from ddp_hpc.training import Callback
from ddp_hpc.engine.checkpoint_files import load_checkpoint
from ddp_hpc.training.job import create_job
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.trainer import Trainer

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False "
                                                      f"here (torch {torch.__version__})")]
DIGITS = str(REPO / "configs" / "digits.yaml")


def _train(tmp_path: Path, name: str, *overrides: str):
    result = run([*ddp_hpc_command(), "train", DIGITS, "training.epochs=2", "distributed.device=cuda",
                  f"logging.run_dir={tmp_path}", f"logging.name={name}", "logging.progress=never", *overrides],
                 timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / name / "summary.json").read_text()), result


def test_doctor_on_cuda_and_nccl():
    ranks = torch.cuda.device_count()  # one rank per GPU: with two or more, nccl's collectives run
    result = run([*ddp_hpc_command(), "launch", "--nproc", str(ranks), "--", "ddp-hpc", "doctor", "--device", "cuda",
                  "--backend", "nccl"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"doctor: OK: {ranks} ranks on 1 node(s), backend nccl" in result.stdout
    assert "cuda:0" in result.stdout


def test_digits_on_cuda_with_bf16_autocast(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 support")
    summary, result = _train(tmp_path, "bf16", "training.precision=bf16")
    assert summary["device"] == "cuda:0" and summary["backend"] == "nccl"
    assert "precision bf16" in result.stderr
    assert summary["final"]["val_accuracy"] > 0.5


def test_digits_on_cuda_with_fp16_and_a_gradient_scaler(tmp_path):
    summary, result = _train(tmp_path, "fp16", "training.precision=fp16")
    assert summary["device"] == "cuda:0" and "precision fp16" in result.stderr
    scaler = load_checkpoint(tmp_path / "fp16" / "checkpoints" / "last.pt")["scaler"]
    assert scaler and scaler["scale"] > 0  # an enabled scaler saved its state
    assert summary["final"]["val_accuracy"] > 0.5


class _Inspect(Callback):
    """Records what the first step saw: device of the parameters, pinned batches, the group's device."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_step_end(self, trainer) -> None:
        if self.seen:
            return
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_group

        batch = next(iter(trainer.loader))
        self.seen = {"parameter_device": next(trainer.model.parameters()).device,
                     "pin_memory": trainer.pin_memory, "loader_pins": trainer.loader.pin_memory,
                     "batch_pinned": batch[0].is_pinned(),
                     "bound_device_id": _get_default_group().bound_device_id if dist.is_initialized() else None,
                     "comm_hook": trainer.ddp_model._get_ddp_logging_data().get("comm_hook")
                     if hasattr(trainer.ddp_model, "_get_ddp_logging_data") else None}


def _fit_on_one_gpu(tmp_path: Path, overrides: list[str], callbacks=()) -> dict:
    config = load_config(DIGITS, [f"logging.run_dir={tmp_path}", "logging.name=gpu", "logging.progress=never",
                                  "training.epochs=1", "distributed.device=cuda", *overrides])
    options = DistributedOptions(device="cuda", backend="nccl", init_single_process=True, timeout_s=120)
    with process_group(options, environ={}) as ctx:  # a one-rank nccl group of its own
        job = create_job(config.job.name, config.job.params)
        return Trainer(job, config, ctx, RunFolder(tmp_path / "gpu"), list(callbacks)).fit()


def test_device_id_pinned_memory_and_the_bf16_comm_hook(tmp_path):
    inspect = _Inspect()
    _fit_on_one_gpu(tmp_path, ["distributed.comm_hook=bf16"], [inspect])
    seen = inspect.seen
    assert seen["parameter_device"] == torch.device("cuda", 0)
    assert seen["bound_device_id"] == torch.device("cuda", 0)  # device_id reached init_process_group
    assert seen["pin_memory"] and seen["loader_pins"] and seen["batch_pinned"]
    assert "bf16_compress_hook" in str(seen["comm_hook"])  # the bf16 hook was accepted on nccl and registered


def _launch_train(tmp_path: Path, name: str, config: list[str], env: dict[str, str]):
    # Under torchrun (one rank), so that the kill callback ends torchrun and its rank, not pytest.
    return run([*ddp_hpc_command(), "launch", "--nproc", "1", "--", "ddp-hpc", "train", DIGITS, *config,
                "distributed.device=cuda", f"logging.run_dir={tmp_path}", f"logging.name={name}",
                "logging.progress=never"], env=env, timeout=600)


@pytest.mark.slow
def test_exact_resume_on_one_gpu(tmp_path):
    config = ["training.epochs=3", "training.deterministic=true", "checkpoint.every_n_steps=5",
              "training.precision=fp32", "data.num_workers=0"]
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": str(REPO / "tests")}  # deterministic cuBLAS
    straight = _launch_train(tmp_path, "straight", config, env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    kill = ["callbacks=[{target: 'fault_injection:KillLaunchAfterCheckpoint', params: {step: 15}}]"]
    killed = _launch_train(tmp_path, "resumed", [*config, *kill], env)
    assert killed.returncode != 0
    checkpoints = tmp_path / "resumed" / "checkpoints"
    assert load_checkpoint(checkpoints / "last.pt")["progress"]["global_step"] == 15
    resumed = _launch_train(tmp_path, "resumed", config, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    assert_same_training_state(load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt"),
                               load_checkpoint(checkpoints / "last.pt"))

"""``training.matmul_precision`` and the tensor-core hint (ddp_hpc/training/matmul.py).

On a CPU host the Trainer's setting is checked for real; the hint's condition and its
once-only logging are checked with the CUDA queries answered by the test (no GPU here).
On a GPU, tests/test_gpu.py checks both on the real device."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ddp_hpc.config import load_config
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.startup.distributed import process_group
from ddp_hpc.training import Callback
from ddp_hpc.training import matmul
from ddp_hpc.training.job import create_job
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.trainer import Trainer

SMALL = ["job.name=synthetic", "job.params.samples=64", "job.params.val_samples=0", "job.params.input_dim=8",
         "job.params.hidden=8", "job.params.depth=1", "training.epochs=1", "training.batch_size=32",
         "logging.progress=never", "logging.plot=false"]


class _SeenAtFirstStep(Callback):
    def on_fit_start(self, trainer) -> None:
        self.precision = torch.get_float32_matmul_precision()


@pytest.fixture
def torch_matmul_precision():
    """Whatever a test sets, torch's setting afterwards is what it was before."""
    before = torch.get_float32_matmul_precision()
    yield before
    torch.set_float32_matmul_precision(before)


def _fit(tmp_path: Path, overrides: list[str]) -> str:
    config = load_config(None, [*SMALL, f"logging.run_dir={tmp_path}", "logging.name=r", *overrides])
    seen = _SeenAtFirstStep()
    with process_group(environ={}) as ctx:
        Trainer(create_job(config.job.name, config.job.params), config, ctx, RunFolder(tmp_path / "r"), [seen]).fit()
    return seen.precision


@pytest.mark.parametrize("setting", ["high", "medium"])
def test_the_trainer_sets_torch_matmul_precision_before_the_model_runs(tmp_path, torch_matmul_precision, setting):
    torch.set_float32_matmul_precision("highest")
    assert _fit(tmp_path, [f"training.matmul_precision={setting}"]) == setting


def test_null_leaves_torch_setting_alone(tmp_path, torch_matmul_precision):
    torch.set_float32_matmul_precision("medium")
    assert _fit(tmp_path, []) == "medium"


def test_an_unknown_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^training\.matmul_precision: expected 'highest' \| 'high' \| 'medium'"):
        load_config(None, ["training.matmul_precision=fast"])


@pytest.mark.parametrize(("capability", "precision", "lower", "hinted"), [
    ((9, 0), "highest", False, True),    # H100, fp32 matmuls on CUDA cores: the hint
    ((8, 0), "highest", False, True),    # A100: the first with TF32
    ((7, 0), "highest", False, False),   # V100: no TF32 tensor cores
    ((9, 0), "high", False, False),      # TF32 already
    ((9, 0), "highest", True, False),    # autocast (or FSDP2 bf16) uses the tensor cores
])
def test_the_hint_is_given_only_where_tensor_cores_sit_idle(capability, precision, lower, hinted):
    hint = matmul.tensor_core_hint("NVIDIA H100 80GB HBM3", capability, precision, lower)
    assert (hint is not None) == hinted
    if hinted:
        assert "NVIDIA H100 80GB HBM3" in hint and "training.matmul_precision" in hint


def test_the_hint_is_logged_once_per_process_and_never_for_a_cpu(monkeypatch, caplog):
    monkeypatch.setattr(matmul, "_hinted", set())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    with caplog.at_level(logging.INFO, logger=matmul.__name__):
        matmul.log_tensor_core_hint(torch.device("cpu"), lower_precision_compute=False)
        assert not caplog.records
        for _ in range(2):
            matmul.log_tensor_core_hint(torch.device("cuda", 0), lower_precision_compute=False)
    assert len(caplog.records) == 1 and "NVIDIA A100-SXM4-80GB" in caplog.records[0].getMessage()

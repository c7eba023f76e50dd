"""scripts/gpu-check.sh on CPU (its dry run, so that it cannot rot where CI has no GPU), and
the parts of its figures that need no device: the bench model's FLOPs, the cards' peaks, MFU.
On a GPU the script itself is the test (docs/performance.md, "GPUs")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import REPO, clean_env, ddp_hpc_command, run
from ddp_hpc.bench.peaks import card_peaks, mfu, training_flops_per_sample
from ddp_hpc.builtin_jobs.synthetic import make_mlp

SCRIPT = REPO / "scripts" / "gpu-check.sh"


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "card", "bf16"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5),
    ("NVIDIA H200", "H200 SXM", 989.5),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
])
def test_known_cards_get_their_datasheet_peaks(name, card, bf16):
    peaks = card_peaks(name)
    assert peaks.name == card and peaks.bf16 == bf16 and peaks.fp32 < peaks.tf32 < peaks.bf16


@pytest.mark.parametrize(("name", "card", "tf32", "bf16"), [
    ("AMD Instinct MI250X", "MI250X (one GCD)", 47.85, 191.5),  # no TF32: its FP32 matrix figure
    ("AMD Instinct MI250X / MI250", "MI250X (one GCD)", 47.85, 191.5),
    ("AMD Instinct MI300X", "MI300X", 653.7, 1307.4),
])
def test_amd_cards_as_torchs_rocm_build_names_them(name, card, tf32, bf16):
    peaks = card_peaks(name)
    assert (peaks.name, peaks.tf32, peaks.bf16) == (card, tf32, bf16) and peaks.fp32 <= peaks.tf32 < peaks.bf16
    assert card_peaks("AMD Instinct MI210") is None


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA H100 NVL", "cpu", "NVIDIA H200 NVL"])
def test_an_unknown_card_gets_no_mfu_and_says_so(name):
    figures = mfu(1000.0, 6_000_000, name, "bf16")
    assert card_peaks(name) is None and figures["mfu"] is None and repr(name) in figures["mfu_note"]
    assert figures["achieved_tflop_s"] == pytest.approx(1000.0 * 6_000_000 / 1e12)


def test_mfu_is_achieved_flops_over_the_peak_of_every_device():
    figures = mfu(90_000.0, 730_000_000, "NVIDIA H100 80GB HBM3", "fp32", devices=2)
    assert figures["mfu"] == pytest.approx(90_000 * 730e6 / 1e12 / (2 * 67.0))


@pytest.mark.parametrize("shape", [(16, 32, 3), (64, 128, 8), (8, 8, 0)])
def test_the_flops_per_sample_are_what_torch_counts_for_a_step_of_the_bench_model(shape):
    from torch.utils.flop_counter import FlopCounterMode

    model = make_mlp(*shape, 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    macs = sum(m.in_features * m.out_features for m in linears)
    assert training_flops_per_sample(*shape) == 6 * macs - 2 * linears[0].in_features * linears[0].out_features
    with FlopCounterMode(display=False) as counter:  # one forward and backward of one sample, counted by torch
        model(torch.randn(1, shape[0])).sum().backward()
    assert counter.get_total_flops() == training_flops_per_sample(*shape)


def test_the_cool_down_epoch_where_the_trainer_saves_at_the_end_is_not_timed():
    from argparse import Namespace

    from ddp_hpc.bench.worker import _loop_result

    # 2 steps per epoch, 1 s each; the last (cool-down) epoch holds a 100 s save.
    stamps = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    epoch_ends = [2.0, 4.0, 6.0, 108.0]
    timed = _loop_result(stamps, epoch_ends, 2, Namespace(epochs=2, warmup_epochs=1, cooldown_epochs=1, batch=4), 1)
    assert timed["mean_step_s"] == 1.0 and timed["epochs_timed"] == 2 and timed["samples_per_s"] == 4.0


def test_the_check_fails_on_a_failed_test_or_step_and_reads_each_outcome(tmp_path):
    driver = _driver()
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.test_gpu" name="test_bad" time="2"><failure message="assert 1 == 2">'
        'tb</failure></testcase>'
        '<testcase classname="tests.test_gpu" name="test_two" time="0"><skipped message="needs two"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_setup" time="0"><error message="fixture"/></testcase>'
        '</testsuite></testsuites>')
    tests = driver.read_junit(junit)
    assert [(t["test"], t["outcome"]) for t in tests] == [
        ("tests/test_gpu.py::test_ok", "passed"), ("tests/test_gpu.py::test_bad", "failed"),
        ("tests/test_gpu.py::test_two", "skipped"), ("tests/test_gpu.py::test_setup", "error")]
    ok_step = {"step": "bench mfu", "ok": True}
    passed, failed, skipped, error = tests
    assert driver.passed({"tests": [passed, skipped], "steps": [ok_step]})
    assert not driver.passed({"tests": [passed, failed], "steps": [ok_step]})
    assert not driver.passed({"tests": [passed, error], "steps": [ok_step]})
    assert not driver.passed({"tests": [passed], "steps": [ok_step, {"step": "bench checkpoints", "ok": False}]})


def test_a_device_for_the_cpu_plan_is_refused_in_one_line(tmp_path):
    result = run([*ddp_hpc_command(), "bench", "--device", "cuda", "--output", str(tmp_path / "b.json")])
    assert result.returncode == 2 and not (tmp_path / "b.json").exists()
    assert result.stderr.strip().splitlines() == [
        "ddp-hpc: error: --device cuda: only bench mfu and bench checkpoints run on a chosen device; bench loops "
        "measures CPU ranks"]


def test_without_a_gpu_it_refuses_in_one_line_unless_asked_for_the_dry_run(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    assert _driver().main([str(tmp_path / "out.json")]) == 2
    assert "--cpu" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


@pytest.mark.slow  # a pytest run and two bench launches: 30 s of CPU, 40-70 s on the loaded 2-core VM
@pytest.mark.timeout(600)
def test_the_dry_run_runs_every_step_on_cpu_into_one_json(tmp_path):
    output = tmp_path / "gpu-check.json"
    one_test = "tests/test_gpu.py::test_bf16_autocast_runs_the_activations_in_bf16"
    # The pytest inside is a run of its own: none of this run's PYTEST_* variables (xdist's worker id).
    env = {k: v for k, v in clean_env({"PYTHON": sys.executable}).items() if not k.startswith("PYTEST_")}
    result = subprocess.run([str(SCRIPT), "--cpu", str(output), "--tests", one_test], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=560)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(output.read_text())
    about = report["gpu_check"]
    assert about["dry_run"] and about["torch"] == torch.__version__ and about["date"] and about["card"] is None
    assert [s["step"] for s in report["steps"]] == ["pytest", "bench mfu", "bench checkpoints", "fence cost"]
    fence = report["figures"]["fence_cost"]
    assert fence["device"] == "cpu" and len(fence["pairs"]) == 2 and fence["abort_ms"] == []
    assert all(s["ok"] for s in report["steps"]) and report["passed"]
    assert [(t["test"], t["outcome"]) for t in report["tests"]] == [(one_test, "skipped")]
    assert "needs a CUDA device" in report["tests"][0]["message"]
    loops = report["figures"]["device_loops"]
    assert loops["device"] == "cpu" and loops["backend"] == "gloo"
    assert [row["precision"] for row in loops["rows"]] == ["fp32", "bf16"]
    for row in loops["rows"]:
        for loop in ("trainer", "handwritten"):
            assert len(row[f"{loop}_samples_per_s"]) == 2 and min(row[f"{loop}_samples_per_s"]) > 0
            assert row[loop]["mfu"] is None and "no peak known for 'cpu'" in row[loop]["mfu_note"]
    (formats,) = report["figures"]["checkpoint_formats"]["runs"]
    assert "host-to-host" in formats["copy_baseline"]["baseline"] and formats["copy_baseline"]["bytes"] > 0
    assert {(m["format"], m["background"]) for m in formats["modes"]} == {
        ("file", False), ("file", True), ("dcp", False), ("dcp", True)}
    assert all(m["error"] is None and m["stall_over_copy"] > 0 for m in formats["modes"])

"""The GPU paths, run for real where there is a CUDA device (``pytest -m "gpu or gpu2"``).

On a host without one every test here skips with that reason (.ci/run deselects them);
``pytest -m "gpu or gpu2" --collect-only`` lists them anywhere. Nothing here fakes a device.
On a one-GPU host every test runs except the ``gpu2`` ones (NCCL between two GPUs); two
ranks share the one GPU through gloo instead. docs/test-world.md lists them.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_training_state, ddp_hpc_command, run
from ddp_hpc.config import load_config
from ddp_hpc.startup.distributed import DistributedOptions, process_group
from ddp_hpc.environment.ports import free_port
from ddp_hpc.training import Callback
from ddp_hpc.engine.checkpoint.files import load_checkpoint
from ddp_hpc.training.job import create_job
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.trainer import Trainer

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False "
                                                      f"here (torch {torch.__version__})")]
DIGITS = str(REPO / "configs" / "digits.yaml")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs two CUDA devices, this host has {torch.cuda.device_count()}")


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


class _ActivationDtypes(Callback):
    """Records the dtype of every Linear and Conv2d output during training steps, and the
    parameters' dtype (autocast leaves them in float32) and type (DTensor under fsdp2)."""

    def __init__(self) -> None:
        self.activations: set[torch.dtype] = set()
        self.parameters: set[torch.dtype] = set()

    def on_fit_start(self, trainer) -> None:
        def record(module, inputs, output) -> None:
            if module.training:
                self.activations.add(output.dtype)

        for module in trainer.model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                module.register_forward_hook(record)
        self.parameters = {p.dtype for p in trainer.model.parameters()}
        self.model = trainer.model
        self.parameter_types = {type(p).__name__ for p in trainer.model.parameters()}


def test_bf16_autocast_runs_the_activations_in_bf16(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 support")
    probe = _ActivationDtypes()
    summary = _fit_on_one_gpu(tmp_path, ["training.precision=bf16"], [probe])
    assert probe.activations == {torch.bfloat16} and probe.parameters == {torch.float32}
    assert summary.final["val_accuracy"] > 0.5


def test_fp16_autocast_runs_the_activations_in_fp16_and_the_scaler_works(tmp_path):
    probe, inspect = _ActivationDtypes(), _Inspect()
    summary = _fit_on_one_gpu(tmp_path, ["training.precision=fp16"], [probe, inspect])
    assert probe.activations == {torch.float16} and probe.parameters == {torch.float32}
    scaler = inspect.scaler
    assert scaler["enabled"] and scaler["steps"] > 0
    # Every step either grew the scaler's run of finite steps or halved its scale.
    assert scaler["state"]["_growth_tracker"] > 0 or scaler["state"]["scale"] < 2.0 ** 16, scaler
    saved = load_checkpoint(tmp_path / "gpu" / "checkpoints" / "last.pt")["scaler"]
    assert saved == scaler["state"]  # the checkpoint carries the scaler's state for a resume
    assert summary.final["val_accuracy"] > 0.5


class _Inspect(Callback):
    """Records what the first step saw: device of the parameters, pinned batches, the group's device."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self.scaler: dict = {}

    def on_fit_end(self, trainer, summary) -> None:
        self.scaler = {"enabled": trainer.scaler.is_enabled(), "state": trainer.scaler.state_dict(),
                       "steps": trainer.progress.global_step}

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


def test_a_one_rank_nccl_group_runs_a_real_all_reduce():
    import torch.distributed as dist

    options = DistributedOptions(device="cuda", backend="nccl", init_single_process=True, timeout_s=120)
    with process_group(options, environ={}) as ctx:
        assert dist.get_backend() == "nccl" and ctx.group_initialized
        values = torch.arange(1.0, 5.0, device="cuda")
        dist.all_reduce(values)  # a sum over one rank: the values come back, through an NCCL kernel
        assert values.tolist() == [1.0, 2.0, 3.0, 4.0]
        # Pre-multiplied sum: NCCL scales each rank's input before summing, so one rank
        # sees its values doubled; no identity could give this.
        dist.all_reduce(values, op=dist._make_nccl_premul_sum(2.0))
        assert values.tolist() == [2.0, 4.0, 6.0, 8.0]
        gathered = torch.empty(4, device="cuda")
        dist.all_gather_into_tensor(gathered, values)
        assert gathered.tolist() == [2.0, 4.0, 6.0, 8.0]
        assert ctx.all_reduce([1.5, 2.5], op="max") == [1.5, 2.5]


def _ddp_rank(rank: int, port: int, backend: str, device_index: int, results) -> None:
    """One of two ranks: an all-reduce of CUDA tensors, then one DDP step whose averaged
    gradient is checked against each rank's own gradient."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            **({"device_id": device} if backend == "nccl" else {}))
    try:
        seen: dict = {"backend": dist.get_backend()}
        summed = torch.tensor([rank + 1.0, 10.0 * rank], device=device)
        dist.all_reduce(summed)
        seen["all_reduce"] = summed.tolist()
        seen["all_reduce_device"] = str(summed.device)

        torch.manual_seed(100 + rank)  # each rank builds different weights: DDP must broadcast rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(device)
        ddp = DistributedDataParallel(model, device_ids=[device_index])
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(weights) for _ in range(2)]
        dist.all_gather(everyone, weights)
        seen["weights_equal_after_wrap"] = bool(torch.equal(everyone[0], everyone[1]))

        batch = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank)).to(device)
        plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(device)
        plain.load_state_dict(model.state_dict())
        plain(batch).pow(2).mean().backward()
        own = torch.cat([p.grad.flatten() for p in plain.parameters()])
        ddp(batch).pow(2).mean().backward()
        averaged = torch.cat([p.grad.flatten() for p in model.parameters()])
        owns = [torch.empty_like(own) for _ in range(2)]
        dist.all_gather(owns, own)
        seen["own_gradients_differ"] = not torch.allclose(owns[0], owns[1])
        seen["gradient_error"] = float((averaged - (owns[0] + owns[1]) / 2).abs().max())
        results.put((rank, seen))
    finally:
        dist.destroy_process_group()


def _two_ranks(backend: str, device_indices: tuple[int, int]) -> dict[int, dict]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_ddp_rank, args=(rank, port, backend, device_indices[rank], results))
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        seen = dict(results.get(timeout=240) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
    return seen


def _assert_a_real_two_rank_ddp(seen: dict[int, dict], backend: str, devices: tuple[str, str]) -> None:
    for rank in (0, 1):
        assert seen[rank]["backend"] == backend
        assert seen[rank]["all_reduce"] == [3.0, 10.0] and seen[rank]["all_reduce_device"] == devices[rank]
        assert seen[rank]["weights_equal_after_wrap"]
        assert seen[rank]["own_gradients_differ"]  # so the average below is a real one
        assert seen[rank]["gradient_error"] < 1e-6, seen[rank]


def test_two_ranks_share_one_gpu_through_gloo_and_plain_ddp():
    _assert_a_real_two_rank_ddp(_two_ranks("gloo", (0, 0)), "gloo", ("cuda:0", "cuda:0"))


def test_two_ranks_share_one_gpu_through_gloo_and_the_trainer(tmp_path):
    # One visible device per rank's view (CUDA_VISIBLE_DEVICES) is how two ranks may share it.
    result = run([*ddp_hpc_command(), "launch", "--nproc", "2", "--", "ddp-hpc", "train", DIGITS,
                  "training.epochs=1", "distributed.device=cuda", "distributed.backend=gloo",
                  f"logging.run_dir={tmp_path}", "logging.name=shared", "logging.progress=never"],
                 env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "shared" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["device"] == "cuda:0" and summary["backend"] == "gloo"
    checksums = summary["parameter_checksums_per_rank"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]  # gloo averaged the CUDA gradients
    assert summary["final"]["val_accuracy"] > 0.5


@pytest.mark.gpu2
@TWO_GPUS
def test_nccl_between_two_gpus_all_reduce_and_a_ddp_step():
    _assert_a_real_two_rank_ddp(_two_ranks("nccl", (0, 1)), "nccl", ("cuda:0", "cuda:1"))


def test_fsdp2_on_one_gpu_computes_in_bf16_and_keeps_fp32_shards(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 support")
    from torch.distributed.fsdp import FSDPModule

    probe = _ActivationDtypes()
    # precision fp32: no autocast, so bf16 activations can only come from the MixedPrecisionPolicy.
    summary = _fit_on_one_gpu(tmp_path, ["training.strategy=fsdp2", "fsdp.wrap=[Linear, Conv2d]",
                                         "fsdp.mixed_precision=bf16", "training.precision=fp32"], [probe])
    assert probe.activations == {torch.bfloat16} and probe.parameters == {torch.float32}
    assert isinstance(probe.model, FSDPModule) and probe.parameter_types == {"DTensor"}
    assert summary.final["val_accuracy"] > 0.5
    # fsdp2 writes sharded (dcp) checkpoints; converted as a user does, the newest holds the
    # whole model in fp32 and loads into the plain model.
    assert (tmp_path / "gpu" / "checkpoints" / "last.dcp").exists()
    weights = _converted_model(tmp_path / "gpu", tmp_path / "model.pt")
    plain = create_job("digits", {"channels": 16, "hidden": 64}).build_model()
    plain.load_state_dict(weights)
    assert {t.dtype for t in weights.values()} == {torch.float32}


def _converted_model(run_folder: Path, output: Path) -> dict[str, torch.Tensor]:
    """``ddp-hpc checkpoint convert RUN OUT.pt``, then the model's weights as docs/api.md loads them."""
    result = run([*ddp_hpc_command(), "checkpoint", "convert", str(run_folder), str(output)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(output, weights_only=True)["model"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2:file"])
def test_background_dcp_saves_of_a_cuda_model_resume_bit_identical(strategy, tmp_path):
    """Two ``Checkpointer(format="dcp", background=True)`` saves of a CUDA model with Adam
    state (the second refills the pinned host buffers of the first) while training goes on;
    each checkpoint restored into a fresh model holds its step's state bit for bit
    (tests/scripts/dcp_background_resume.py; tests/test_stacks.py runs it on CPU).
    ``fsdp2:file``: an FSDP2 model's ``format="file"`` checkpoint, its whole state gathered
    from the GPU into one file, restored into the shards bit for bit."""
    result = run([sys.executable, str(REPO / "tests" / "scripts" / "dcp_background_resume.py"), str(tmp_path), "cuda",
                  strategy], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resumed ")]
    assert resumed == [f"resumed {strategy} step 3", f"resumed {strategy} step 5"], result.stdout


def test_a_background_snapshot_of_cuda_tensors_is_pinned_complete_on_return_and_refilled_in_place():
    """host_copy.snapshot (both background formats' copy): from CUDA into pinned host
    buffers with non-blocking copies, so it must synchronize before it returns: the copy of
    a 256 MiB tensor is checked at once, before anything else waits on the device."""
    from ddp_hpc.engine.checkpoint.host_copy import snapshot

    cache: dict = {}
    live = {"w": torch.full((64, 1024, 1024), 1.0, device="cuda"), "step": torch.tensor(3.0, device="cuda")}
    first = snapshot(live, cache)
    assert bool((first["w"] == 1.0).all()) and first["w"].is_pinned() and first["w"].device.type == "cpu"
    live["w"].fill_(2.0)
    second = snapshot(live, cache)
    assert bool((second["w"] == 2.0).all()) and second["w"].data_ptr() == first["w"].data_ptr()
    assert float(second["step"]) == 3.0


@pytest.mark.gpu2
@TWO_GPUS
def test_fsdp2_over_nccl_between_two_gpus_holds_half_the_state_on_each(tmp_path):
    result = run([*ddp_hpc_command(), "launch", "--nproc", "2", "--", "ddp-hpc", "train", DIGITS,
                  "training.epochs=2", "distributed.device=cuda", "training.strategy=fsdp2", "fsdp.wrap=[Linear]",
                  "fsdp.mixed_precision=bf16", f"logging.run_dir={tmp_path}", "logging.name=fsdp2",
                  "logging.progress=never"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "fsdp2" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "nccl" and summary["device"] == "cuda:0"
    checksums = summary["parameter_checksums_per_rank"]
    assert checksums[0] == checksums[1]  # each rank's checksum is of the gathered model
    # Adam: the parameters and two moments, each of them halved over the two GPUs.
    whole = 3 * 4 * sum(p.numel() for p in create_job("digits", {"channels": 16, "hidden": 64}).build_model().parameters())
    assert all(0.45 * whole <= held <= 1.1 * whole / 2 for held in summary["state_bytes_per_rank"]), summary
    assert summary["final"]["val_accuracy"] > 0.5


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


class _MatmulPrecisionAtFitStart(Callback):
    def on_fit_start(self, trainer) -> None:
        self.precision = torch.get_float32_matmul_precision()


def test_the_tensor_core_hint_and_training_matmul_precision(tmp_path, monkeypatch, caplog):
    """fp32 at torch's default on a tensor-core GPU: the hint, once; with
    ``training.matmul_precision: high``: TF32 on the rank, and no hint."""
    from ddp_hpc.training import matmul

    monkeypatch.setattr(matmul, "_hinted", set())
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with caplog.at_level(logging.INFO, logger=matmul.__name__):
            _fit_on_one_gpu(tmp_path / "fp32", ["training.precision=fp32"])
        tensor_cores = torch.cuda.get_device_capability(0) >= matmul.TENSOR_CORE_CAPABILITY
        assert len([r for r in caplog.records if "tensor cores" in r.getMessage()]) == (1 if tensor_cores else 0)
        caplog.clear()
        probe = _MatmulPrecisionAtFitStart()
        with caplog.at_level(logging.INFO, logger=matmul.__name__):
            _fit_on_one_gpu(tmp_path / "tf32", ["training.precision=fp32", "training.matmul_precision=high"], [probe])
        assert probe.precision == "high"
        assert not [r for r in caplog.records if "tensor cores" in r.getMessage()]
    finally:
        torch.set_float32_matmul_precision(before)

"""Device and backend selection. Hosts with GPUs are described, not faked into running:
only the choice is under test; the real host is tested as what it is (tests/test_gpu.py
runs the GPU paths for real where there is a CUDA device)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from ddp_hpc.device import DeviceChoice, TorchHost, requested, select_device
from ddp_hpc.errors import DeviceUnavailableError, UserError


@dataclass
class FakeHost:
    cuda: int = 0
    xpu: int = 0
    backends: set[str] = field(default_factory=lambda: {"gloo"})

    def device_count(self, device_type: str) -> int:
        return {"cuda": self.cuda, "xpu": self.xpu, "cpu": 1}[device_type]

    def backend_available(self, backend: str) -> bool:
        return backend in self.backends

    def describe_build(self) -> str:
        return "torch test-build"


CUDA_HOST = FakeHost(cuda=4, backends={"gloo", "nccl"})
XPU_NATIVE = FakeHost(xpu=12, backends={"gloo", "xccl"})
XPU_BINDINGS = FakeHost(xpu=12, backends={"gloo", "ccl"})
CPU_HOST = FakeHost()


@pytest.mark.parametrize("host,device,backend,local_rank,expected", [
    (CPU_HOST, "auto", "auto", 1, DeviceChoice("cpu", "gloo", None)),
    (CUDA_HOST, "auto", "auto", 3, DeviceChoice("cuda", "nccl", 3)),
    (XPU_NATIVE, "auto", "auto", 11, DeviceChoice("xpu", "xccl", 11)),
    (XPU_BINDINGS, "auto", "auto", 5, DeviceChoice("xpu", "ccl", 5)),
    (CUDA_HOST, "cpu", "auto", 2, DeviceChoice("cpu", "gloo", None)),
    (CUDA_HOST, "cuda", "gloo", 1, DeviceChoice("cuda", "gloo", 1)),
    (CUDA_HOST, "auto", "gloo", 1, DeviceChoice("cpu", "gloo", None)),
    (CUDA_HOST, "auto", "nccl", 2, DeviceChoice("cuda", "nccl", 2)),
    (XPU_BINDINGS, "auto", "ccl", 0, DeviceChoice("xpu", "ccl", 0)),
    (FakeHost(cuda=4, xpu=4, backends={"gloo", "nccl", "xccl"}), "auto", "auto", 0,
     DeviceChoice("xpu", "xccl", 0)),
])
def test_choices(host, device, backend, local_rank, expected):
    got = select_device(device, backend, local_rank=local_rank, local_world_size=4, host=host, env={})
    assert got == expected


def test_device_ids_are_integers():
    choice = select_device("cuda", "nccl", local_rank=3, local_world_size=4, host=CUDA_HOST, env={})
    assert choice.ddp_device_ids == [3] and isinstance(choice.ddp_device_ids[0], int)
    assert choice.init_device_id == torch.device("cuda", 3)
    cpu = select_device("cpu", "gloo", host=CPU_HOST, env={})
    assert cpu.ddp_device_ids is None and cpu.init_device_id is None


@pytest.mark.parametrize("host,device,backend,fragment", [
    (CPU_HOST, "cpu", "nccl", "backend 'nccl' cannot communicate cpu tensors"),
    (CPU_HOST, "auto", "nccl", "backend 'nccl' was requested but torch test-build sees no cuda"),
    (CPU_HOST, "cuda", "auto", "device 'cuda' was requested but torch test-build sees no cuda"),
    (CPU_HOST, "xpu", "auto", "device 'xpu' was requested but torch test-build sees no xpu"),
    (FakeHost(xpu=12, backends={"gloo"}), "xpu", "ccl", "backend 'ccl' is not available"),
    (FakeHost(xpu=12, backends={"gloo"}), "xpu", "auto", "backend 'xccl' is not available"),
    (FakeHost(cuda=4, backends={"gloo"}), "cuda", "nccl", "NCCL ships only with CUDA builds"),
    (CUDA_HOST, "cuda", "xccl", "backend 'xccl' cannot communicate cuda tensors"),
    (CPU_HOST, "tpu", "auto", "unknown device 'tpu'"),
    (CPU_HOST, "cpu", "mpi", "unknown backend 'mpi'"),
])
def test_impossible_choices_are_refused_in_one_line(host, device, backend, fragment):
    with pytest.raises(UserError) as err:
        select_device(device, backend, local_rank=0, local_world_size=1, host=host, env={})
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_more_local_ranks_than_gpus_is_refused():
    with pytest.raises(DeviceUnavailableError, match="8 ranks on this node but only 4 cuda"):
        select_device("cuda", "nccl", local_rank=5, local_world_size=8, host=CUDA_HOST, env={})


def test_one_visible_device_per_rank_uses_index_zero():
    one_gpu = FakeHost(cuda=1, backends={"nccl", "gloo"})
    choice = select_device("cuda", "nccl", local_rank=3, local_world_size=4, host=one_gpu,
                           env={"CUDA_VISIBLE_DEVICES": "3"})
    assert choice.index == 0
    with pytest.raises(DeviceUnavailableError):
        select_device("cuda", "nccl", local_rank=3, local_world_size=4, host=one_gpu, env={})


def test_request_precedence():
    env = {"DDP_HPC_DEVICE": "CPU"}
    assert requested("cuda", env, "DDP_HPC_DEVICE", "xpu") == "cuda"
    assert requested(None, env, "DDP_HPC_DEVICE", "xpu") == "cpu"
    assert requested(None, {}, "DDP_HPC_DEVICE", "xpu") == "xpu"
    assert requested(None, {}, "DDP_HPC_DEVICE") == "auto"


def test_this_host_for_real():
    """The real host, whatever it has: a CPU-only host picks cpu+gloo and refuses nccl; a
    CUDA host picks cuda+nccl on device 0 (and one device per local rank)."""
    host = TorchHost()
    assert host.device_count("cuda") == torch.cuda.device_count()
    assert host.backend_available("gloo")
    cpu = select_device("cpu", "auto", host=host, env={})
    assert cpu == DeviceChoice("cpu", "gloo", None)
    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    if torch.cuda.is_available() and not xpu:
        count = torch.cuda.device_count()
        assert host.backend_available("nccl")
        assert select_device(host=host, env={}) == DeviceChoice("cuda", "nccl", 0)
        last = select_device("auto", "auto", local_rank=count - 1, local_world_size=count, host=host, env={})
        assert last == DeviceChoice("cuda", "nccl", count - 1)
        assert last.init_device_id == torch.device("cuda", count - 1)
    elif not xpu:
        assert select_device(host=host, env={}) == DeviceChoice("cpu", "gloo", None)
        with pytest.raises(DeviceUnavailableError):
            select_device("auto", "nccl", host=host, env={})


def test_a_host_without_gpu_device_files_is_answered_without_torch_and_as_torch_answers(tmp_path):
    """``ddp-hpc run`` on a CPU host: ``probe_host`` decides without importing torch (the
    command imports it anyway), and only where torch could not answer otherwise: any GPU
    device file, or a request that names a GPU or another backend, asks torch."""
    import subprocess
    import sys

    from ddp_hpc.device import NoGpuHost, probe_host

    assert NoGpuHost.here(tmp_path)
    for trace in ("dev/nvidia0", "proc/driver/nvidia/gpus/0000:07:00.0", "dev/nvhost-ctrl-gpu", "dev/dri/renderD128",
                  "sys/class/drm/renderD128", "dev/kfd", "sys/class/kfd", "dev/dxg"):
        root = tmp_path / trace.replace("/", "-")
        (root / trace).parent.mkdir(parents=True, exist_ok=True)
        (root / trace).touch()
        assert not NoGpuHost.here(root), trace
    if NoGpuHost.here():  # this host: the same choice as torch's, for every request it takes
        for device, backend in (("auto", "auto"), ("cpu", "auto"), ("auto", "gloo"), ("cpu", "gloo")):
            assert isinstance(probe_host(device, backend), NoGpuHost)
            assert (select_device(device, backend, host=NoGpuHost(), env={})
                    == select_device(device, backend, host=TorchHost(), env={}))
    for device, backend in (("cuda", "auto"), ("xpu", "auto"), ("auto", "nccl"), ("cpu", "ccl")):
        assert isinstance(probe_host(device, backend), TorchHost), (device, backend)
    probe = ("import sys; from ddp_hpc.torchrun_env import command_environment; "
             "launch = command_environment(['true'], environ={'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', "
             "'LOCAL_WORLD_SIZE': '1', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '29500'}); "
             "print('torch' in sys.modules, launch.exported.get('DDP_HPC_DEVICE'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == (["False", "cpu"] if NoGpuHost.here() else ["True", out[1]]), out

"""Device and backend selection. Hosts with GPUs are described, not faked into running:
only the choice is under test; the real host is tested as what it is (tests/test_gpu.py
runs the GPU paths for real where there is a CUDA device)."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import ddp_hpc_command, run
from ddp_hpc.device import DeviceChoice, TorchHost, backend_advice, intel_gpu_here, requested, select_device
from ddp_hpc.errors import DeviceUnavailableError, UserError


@dataclass
class FakeHost:
    cuda: int = 0
    xpu: int = 0
    backends: set[str] = field(default_factory=lambda: {"gloo"})
    version: str = "2.8.0"

    def device_count(self, device_type: str) -> int:
        return {"cuda": self.cuda, "xpu": self.xpu, "cpu": 1}[device_type]

    def backend_available(self, backend: str) -> bool:
        return backend in self.backends

    def describe_build(self) -> str:
        return "torch test-build"

    def torch_version(self) -> str:
        return self.version


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
    probe = ("import sys; from ddp_hpc.run.torchrun_env import command_environment; "
             "launch = command_environment(['true'], environ={'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', "
             "'LOCAL_WORLD_SIZE': '1', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '29500'}); "
             "print('torch' in sys.modules, launch.exported.get('DDP_HPC_DEVICE'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == (["False", "cpu"] if NoGpuHost.here() else ["True", out[1]]), out


IPEX = "intel_extension_for_pytorch"
#: What an IPEX built for another torch does on import (IPEX 2.x against a torch it was not built for).
BROKEN_IPEX = ('print("ERROR! Intel Extension for PyTorch* needs to work with PyTorch 2.8.*, but PyTorch 2.5.1 is '
               'found. Please switch to the matching version and run again.")\n'
               'raise AttributeError("module \'os\' has no attribute \'exit\'")\n')
#: An IPEX that imports and leaves a trace of it.
RECORDING_IPEX = "import sys\nsys.ipex_imported = True\n"


def fake_package(root: Path, code: str, name: str = IPEX) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(code)
    return root


def sysfs(root: Path, *vendors: str, render_node: bool = True) -> Path:
    """A host root whose DRM devices have these PCI vendors."""
    for number, vendor in enumerate(vendors):
        card = root / f"sys/class/drm/card{number}/device"
        card.mkdir(parents=True)
        (card / "vendor").write_text(f"{vendor}\n")
    if render_node:
        (root / "dev/dri").mkdir(parents=True)
        (root / "dev/dri/renderD128").touch()
    return root


def test_an_intel_gpu_is_one_whose_drm_device_is_intels(tmp_path):
    assert not intel_gpu_here(tmp_path / "empty")
    assert not intel_gpu_here(sysfs(tmp_path / "nvidia", "0x10de"))  # an NVIDIA GPU
    assert not intel_gpu_here(sysfs(tmp_path / "bmc", "0x1a03"))  # a server's ASPEED graphics
    assert intel_gpu_here(sysfs(tmp_path / "pvc", "0x1a03", "0x8086"))
    assert intel_gpu_here(sysfs(tmp_path / "no-sysfs", render_node=True))  # vendor unknown: it can be
    (tmp_path / "wsl/dev").mkdir(parents=True)
    (tmp_path / "wsl/dev/dxg").touch()
    assert intel_gpu_here(tmp_path / "wsl")


@pytest.fixture
def no_native_xpu():
    if torch.xpu._is_compiled():
        pytest.skip("this torch has native XPU support: IPEX is never imported for devices")


@pytest.fixture
def ipex_on_path(tmp_path, monkeypatch):
    """Puts a fake IPEX with the given code first on sys.path; no IPEX is imported before or after."""
    def put(code: str) -> None:
        monkeypatch.syspath_prepend(str(fake_package(tmp_path / "path", code)))

    sys.modules.pop(IPEX, None)
    yield put
    sys.modules.pop(IPEX, None)
    if hasattr(sys, "ipex_imported"):
        del sys.ipex_imported


@pytest.mark.usefixtures("no_native_xpu")
def test_ipex_is_imported_only_where_an_intel_gpu_can_be_or_xpu_was_asked_for(tmp_path, ipex_on_path):
    ipex_on_path(RECORDING_IPEX)
    cuda_host = sysfs(tmp_path / "cuda-host", "0x10de")
    assert TorchHost(root=cuda_host).device_count("xpu") == 0
    assert TorchHost(root=tmp_path / "cpu-host").device_count("xpu") == 0
    assert IPEX not in sys.modules and not hasattr(sys, "ipex_imported")
    TorchHost(xpu_requested=True, root=cuda_host).device_count("xpu")
    assert getattr(sys, "ipex_imported", False)
    del sys.modules[IPEX], sys.ipex_imported
    TorchHost(root=sysfs(tmp_path / "intel-host", "0x8086")).device_count("xpu")
    assert getattr(sys, "ipex_imported", False)


@pytest.mark.usefixtures("no_native_xpu")
def test_the_default_choice_on_a_host_without_an_intel_gpu_never_imports_ipex(ipex_on_path):
    if intel_gpu_here():
        pytest.skip("this host can have an Intel GPU")
    ipex_on_path(RECORDING_IPEX)
    assert select_device(env={}).device_type != "xpu"
    assert IPEX not in sys.modules


@pytest.mark.usefixtures("no_native_xpu")
def test_a_broken_ipex_on_an_intel_host_is_one_warning_and_no_xpu(tmp_path, ipex_on_path, caplog, capsys):
    ipex_on_path(BROKEN_IPEX)
    with caplog.at_level(logging.WARNING, logger="ddp_hpc.device"):
        assert TorchHost(root=sysfs(tmp_path / "intel-host", "0x8086")).device_count("xpu") == 0
    assert [r.getMessage() for r in caplog.records] == [
        "intel_extension_for_pytorch failed to import (ERROR! Intel Extension for PyTorch* needs to work with "
        "PyTorch 2.8.*, but PyTorch 2.5.1 is found. Please switch to the matching version and run again.; "
        "AttributeError: module 'os' has no attribute 'exit'): XPU devices left unused"]
    assert capsys.readouterr() == ("", "")  # what IPEX printed is in that line, not on the console


@pytest.mark.parametrize("raised", ["RuntimeError('no Level Zero driver')", "SystemExit(127)",
                                    "ImportError('libsycl.so.8: cannot open shared object file')"])
@pytest.mark.usefixtures("no_native_xpu")
def test_an_ipex_that_fails_in_any_way_leaves_no_xpu_and_names_why_when_asked(ipex_on_path, raised):
    ipex_on_path(f"raise {raised}\n")
    with pytest.raises(DeviceUnavailableError) as refused:
        select_device("xpu", env={})
    assert "intel_extension_for_pytorch failed to import (" + raised.split("(")[0] in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("backend,version,fragment", [
    ("xccl", "2.5.1+cxx11.abi", "with torch 2.5.1+cxx11.abi use --backend ccl with Intel's oneCCL bindings"),
    ("xccl", "2.8.0+cpu", "pip install torch==2.8.0 --index-url https://download.pytorch.org/whl/xpu"),
    ("ccl", "2.7.1", "install Intel's oneCCL bindings built for torch 2.7 (oneccl_bind_pt from Intel's index"),
    ("ccl", "2.8.0+xpu", "install Intel's oneCCL bindings built for torch 2.8"),
    ("ccl", "2.9.0+xpu", "Intel's oneCCL bindings end at torch 2.8; with torch 2.9.0+xpu use --backend xccl"),
])
def test_the_advice_for_a_missing_intel_backend_fits_the_installed_torch(backend, version, fragment):
    assert fragment in backend_advice(backend, version)
    with pytest.raises(DeviceUnavailableError, match="backend '" + backend):
        select_device("xpu", backend, host=FakeHost(xpu=12, version=version), env={})


@pytest.mark.slow
@pytest.mark.usefixtures("no_native_xpu")
def test_a_broken_ipex_leaves_env_doctor_and_train_on_cpu_unaffected(tmp_path):
    """An IPEX that raises AttributeError on import (one built for another torch) on the path."""
    env = {"PYTHONPATH": str(fake_package(tmp_path / "path", BROKEN_IPEX))}
    cli = ddp_hpc_command()
    for args, done in ((["env"], "device=cpu backend=gloo"), (["doctor"], "doctor: OK: 1 ranks"),
                       (["train", "configs/digits.yaml", "training.epochs=1", f"logging.run_dir={tmp_path}/runs",
                         "logging.plot=false"], "done: 1 epochs")):
        result = run([*cli, *args], env=env, timeout=240)
        assert result.returncode == 0, result.stderr[-2000:]
        assert done in result.stdout
        assert "ERROR!" not in result.stdout + result.stderr and "Traceback" not in result.stderr
    refused = run([*cli, "env", "--device", "xpu"], env=env)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "AttributeError: module 'os' has no attribute 'exit'" in refused.stderr


def _rocm_torch(monkeypatch, devices: int = 8):
    """A stand-in for torch's ROCm build: ``torch.version.hip`` set, no ``version.cuda``, its
    ``cuda`` device an AMD GPU and ``nccl`` available (RCCL). Nothing here ran on AMD hardware."""
    import types

    fake = types.ModuleType("torch")
    fake.__version__ = "2.5.1+rocm6.2"
    fake.version = types.SimpleNamespace(hip="6.2.41133", cuda=None)
    fake.cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: devices)
    fake.device = lambda kind, index=None: f"{kind}:{index}" if index is not None else kind
    distributed = types.ModuleType("torch.distributed")
    distributed.is_available = lambda: True
    distributed.is_backend_available = lambda name: name in ("gloo", "nccl")
    fake.distributed = distributed
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch.distributed", distributed)
    return fake


def test_a_rocm_build_is_cuda_over_rccl(monkeypatch, capsys, tmp_path):
    from ddp_hpc import cli
    from ddp_hpc.device import backend_label
    from ddp_hpc.engine.recovery.backends import host_refusal

    _rocm_torch(monkeypatch)
    host = TorchHost()
    assert host.device_count("cuda") == 8
    assert host.describe_build() == "torch 2.5.1+rocm6.2 (ROCm 6.2.41133: cuda is HIP, nccl is RCCL)"
    assert select_device("auto", "auto", local_rank=5, local_world_size=8, host=host, env={}) == \
        DeviceChoice("cuda", "nccl", 5)
    assert (backend_label("nccl"), backend_label("gloo")) == ("nccl (RCCL, ROCm 6.2.41133)", "gloo")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["env", "--device", "cuda"]) == 0
    assert "device=cuda:0 backend=nccl (RCCL, ROCm 6.2.41133) " in capsys.readouterr().out
    assert cli.main(["env", "--device", "cuda", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["backend"], report["backend_library"]) == ("nccl", "nccl (RCCL, ROCm 6.2.41133)")
    # --recover's host check: an AMD host (ROCm's /dev/kfd) runs nccl as RCCL.
    assert host_refusal("nccl", tmp_path) is not None
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kfd").touch()
    assert host_refusal("nccl", tmp_path) is None


def test_a_cuda_build_keeps_its_backend_name(monkeypatch):
    from ddp_hpc.device import backend_label

    fake = _rocm_torch(monkeypatch)
    fake.version = type(fake.version)(hip=None, cuda="12.4")
    assert backend_label("nccl") == "nccl"
    assert TorchHost().describe_build() == "torch 2.5.1+rocm6.2 (12.4)"


def test_ddp_hpc_run_lets_ranks_share_one_gpu_when_nothing_was_asked_for(caplog):
    """``ddp-hpc run`` with 4 ranks on a 1-GPU node: nothing asked for, the command picks its
    own device (ranks sharing the GPU over gloo, as examples/recovering_loop.py's DEVICE=cuda
    does; refused before, seen on an H200 on 2026-11-28), said once and no device exported;
    cuda or nccl asked for is still refused in one line."""
    from ddp_hpc.run.torchrun_env import command_environment

    one_gpu = FakeHost(cuda=1, backends={"nccl", "gloo"})
    ranks = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    launch = command_environment(["true"], environ=ranks, host=one_gpu)
    assert "DDP_HPC_DEVICE" not in launch.exported and "DDP_HPC_BACKEND" not in launch.exported
    assert launch.exported["LOCAL_WORLD_SIZE"] == "4"
    assert "4 ranks on this node but only 1 cuda device(s)" in caplog.text
    for asked in ({"DDP_HPC_DEVICE": "cuda"}, {"DDP_HPC_BACKEND": "nccl"}):
        with pytest.raises(DeviceUnavailableError, match="4 ranks on this node but only 1 cuda"):
            command_environment(["true"], environ={**ranks, **asked}, host=one_gpu)

"""Choose this rank's device and communication backend, or refuse an impossible choice.

``auto`` picks the first available of xpu, cuda, cpu. Backends: cuda -> nccl; xpu -> xccl
where the installed torch has it, else ccl from oneccl_bindings_for_pytorch; cpu -> gloo.
Everything is decided before any process group exists, so a wrong choice costs one
line on stderr instead of a hung job. Intel's packages (IPEX, the oneCCL bindings) are
imported only where an Intel GPU can be present or XPU/ccl was asked for, and however
they fail to import, they never end a run (docs/devices.md has the routes).
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import sys
from collections.abc import Mapping
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ddp_hpc.errors import DeviceUnavailableError, TooFewDevicesError, UserError
from ddp_hpc.torch_support import IPEX_LAST, XCCL, installed, named, parse

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEVICE_TYPES = ("auto", "xpu", "cuda", "cpu")
BACKENDS = ("auto", "nccl", "xccl", "ccl", "gloo")

#: Backends that can move tensors living on each device type, preferred first.
COMPATIBLE_BACKENDS: dict[str, tuple[str, ...]] = {
    "cuda": ("nccl", "gloo"),
    "xpu": ("xccl", "ccl"),
    "cpu": ("gloo", "ccl"),
}
#: torch's NCCL error handling: ``1`` (a NCCL error ends the rank, as torchrun sets it) unless
#: the user set it; ``0`` under in-job recovery, which aborts a broken group itself.
NCCL_ERROR_HANDLING_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: torch's NCCL heartbeat monitor: ``0`` under in-job recovery. A survivor's watchdog that saw
#: a peer's error leaves a dump request in the launch's store, which every NCCL group's store
#: is a prefix of; a replacement's monitor would read it and end the replacement minutes later.
NCCL_MONITORING_VAR = "TORCH_NCCL_ENABLE_MONITORING"
#: Backends whose init_process_group takes ``device_id`` (binds the communicator eagerly).
DEVICE_ID_BACKENDS = frozenset({"nccl", "xccl"})
#: Variables a scheduler or wrapper uses to give each rank its own single device.
VISIBLE_DEVICE_VARS = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK"}


#: Where PyTorch's own XPU builds of torch are served (native torch.xpu; xccl from torch 2.8).
XPU_INDEX = "https://download.pytorch.org/whl/xpu"
#: PCI vendor id of Intel's GPUs, as sysfs spells it.
INTEL_VENDOR = "0x8086"


class HostDevices(Protocol):
    """What this host offers; ``TorchHost`` asks torch, tests pass a description."""

    def device_count(self, device_type: str) -> int: ...

    def backend_available(self, backend: str) -> bool: ...

    def describe_build(self) -> str: ...

    def torch_version(self) -> str: ...


def intel_gpu_here(root: Path = Path("/")) -> bool:
    """Whether an Intel GPU can be on this host: a DRM device whose PCI vendor is Intel's,
    or, where sysfs names no DRM vendor (some containers, WSL2), a render node or WSL's dxg."""
    vendors = list(root.glob("sys/class/drm/*/device/vendor"))
    if vendors:
        return any(_read(vendor) == INTEL_VENDOR for vendor in vendors)
    return any(next(root.glob(pattern), None) for pattern in ("dev/dri/renderD*", "dev/dxg"))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip().lower()
    except OSError:
        return ""


class TorchHost:
    """The real host, probed through torch. Intel's packages are imported only where an
    Intel GPU can be present (``intel_gpu_here``) or XPU/ccl was asked for
    (``xpu_requested``), and only if the installed torch needs them."""

    def __init__(self, xpu_requested: bool = False, root: Path = Path("/")) -> None:
        self.xpu_requested = xpu_requested
        self.root = root
        #: Why an Intel package that is installed did not import, for the refusal that follows.
        self.import_failures: dict[str, str] = {}

    def device_count(self, device_type: str) -> int:
        import torch

        if device_type == "cuda":
            return torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device_type == "xpu":
            return self._xpu_count
        return 1

    @cached_property
    def _xpu_count(self) -> int:
        import torch

        if not (self.xpu_requested or intel_gpu_here(self.root)):
            return 0
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu._is_compiled():
            # torch builds without native XPU support get it from IPEX.
            if not self._imports("intel_extension_for_pytorch"):
                return 0
            xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0

    def backend_available(self, backend: str) -> bool:
        import torch.distributed as dist

        if backend == "ccl":
            return self._ccl_bindings
        return dist.is_available() and dist.is_backend_available(backend)

    @cached_property
    def _ccl_bindings(self) -> bool:
        # Importing the bindings registers the "ccl" backend with torch.distributed.
        return self._imports("oneccl_bindings_for_pytorch")

    def _imports(self, module: str) -> bool:
        failure = import_failure(module)
        if failure is None:
            return True
        if failure:
            self.import_failures[module] = failure
            if not self.xpu_requested:  # asked for, the refusal that follows says it
                log.warning("%s: XPU devices left unused", failure)
        return False

    def describe_build(self) -> str:
        import torch

        hip = rocm_version(torch)
        cuda = torch.version.cuda or (f"ROCm {hip}: cuda is HIP, nccl is RCCL" if hip else "no CUDA")
        failures = "".join(f"; {failure}" for failure in self.import_failures.values())
        return f"torch {torch.__version__} ({cuda}{failures})"

    def torch_version(self) -> str:
        return installed()


def rocm_version(torch_module: object) -> str | None:
    """The ROCm (HIP) version of a ROCm build of torch (``torch.version.hip``), else None. On
    such a build the ``cuda`` device is an AMD GPU through HIP and ``nccl`` is RCCL."""
    return getattr(getattr(torch_module, "version", None), "hip", None) or None


def backend_label(backend: str) -> str:
    """The backend as ``env`` and ``doctor`` print it: ``nccl (RCCL, ROCm 6.2)`` on torch's
    ROCm build, which names RCCL ``nccl``. Asks only a torch already imported."""
    hip = rocm_version(sys.modules.get("torch")) if backend == "nccl" else None
    return f"nccl (RCCL, ROCm {hip})" if hip else backend


def import_failure(module: str) -> str | None:
    """Import ``module``: None if it imported, ``""`` if it is not installed, else why it
    failed, in one line. Intel's packages fail in any way against a torch they were not
    built for (IPEX prints an error, then raises AttributeError from a call to ``os.exit``):
    whatever they print while failing is folded into that line, not left on the console."""
    printed = io.StringIO()
    try:
        with redirect_stdout(printed), redirect_stderr(printed):
            importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return ""
        return _failure_line(module, printed.getvalue(), exc)
    except (Exception, SystemExit) as exc:  # SystemExit too: a package must not end the run
        return _failure_line(module, printed.getvalue(), exc)
    sys.stderr.write(printed.getvalue())  # it imported: its own notes stay
    return None


def _failure_line(module: str, printed: str, exc: BaseException) -> str:
    said = [line.strip() for line in printed.splitlines() if line.strip()][:1]
    message = str(exc).strip().splitlines()
    raised = f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
    return f"{module} failed to import ({'; '.join([*said, raised])})"


#: What a GPU leaves on its host, under ``/``: NVIDIA's device files (/dev/nvidia0 ...; the
#: driver may make them only on first use, but its loaded module lists every GPU under
#: /proc/driver/nvidia/gpus), Jetson's nvhost/nvgpu, a DRM render node (Intel, AMD; in /dev
#: and /sys), ROCm's kfd, WSL2's dxg. Without any of them torch sees no GPU.
NVIDIA_TRACES = ("dev/nvidia[0-9]*", "proc/driver/nvidia/gpus/*", "dev/nvhost-ctrl-gpu", "dev/nvgpu", "dev/dxg")
#: What a GPU torch's ``cuda`` device can run on leaves: NVIDIA's, or AMD's kfd (ROCm's kernel
#: driver), where torch's ROCm build drives it through HIP and its ``nccl`` backend is RCCL.
CUDA_TRACES = (*NVIDIA_TRACES, "dev/kfd")
GPU_TRACES = (*NVIDIA_TRACES, "dev/dri/renderD*", "sys/class/drm/renderD*", "dev/kfd", "sys/class/kfd")


class NoGpuHost:
    """A host without any trace of a GPU: cpu and gloo, decided without importing torch.

    ``ddp-hpc run`` execs the user's command, which imports torch itself: on a CPU job its
    own torch import (about 2 s of CPU per rank, more from a shared file system) would be
    spent only to learn that there is no GPU. Used only where the request is cpu or auto
    with gloo or auto; any GPU trace (a server's BMC graphics included: then torch is asked,
    as before), or any other request, asks torch."""

    @staticmethod
    def here(root: Path = Path("/")) -> bool:
        return not any(next(root.glob(pattern), None) for pattern in GPU_TRACES)

    def device_count(self, device_type: str) -> int:
        return 1 if device_type == "cpu" else 0

    def backend_available(self, backend: str) -> bool:
        return backend == "gloo"  # every torch build for Linux and macOS has gloo

    def describe_build(self) -> str:
        return "this host (no GPU device files)"

    def torch_version(self) -> str:
        return installed()


def probe_host(device: str, backend: str) -> HostDevices:
    """The cheapest host probe that answers ``device``/``backend`` requests as torch would."""
    if device in ("auto", "cpu") and backend in ("auto", "gloo") and NoGpuHost.here():
        return NoGpuHost()
    return torch_host(device, backend)


def torch_host(device: str, backend: str) -> TorchHost:
    """The host probed through torch, for a request of ``device``/``backend``."""
    return TorchHost(xpu_requested=device.lower() == "xpu" or backend.lower() in ("xccl", "ccl"))


@dataclass(frozen=True)
class DeviceChoice:
    """The device this rank computes on and the backend its collectives use."""

    device_type: str
    backend: str
    index: int | None

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device_type, self.index) if self.index is not None else torch.device("cpu")

    @property
    def ddp_device_ids(self) -> list[int] | None:
        """``device_ids`` for DistributedDataParallel: integer indices, or None on CPU."""
        return None if self.index is None else [self.index]

    @property
    def init_device_id(self) -> torch.device | None:
        """``device_id`` for init_process_group where the backend takes one."""
        return self.torch_device if self.backend in DEVICE_ID_BACKENDS and self.index is not None else None

    def activate(self) -> None:
        """Make this rank's device current, before the process group is created."""
        import torch

        if self.device_type == "cuda" and self.index is not None:
            torch.cuda.set_device(self.index)
        elif self.device_type == "xpu" and self.index is not None:
            torch.xpu.set_device(self.index)

    def __str__(self) -> str:
        return f"{self.torch_device}+{self.backend}"


def requested(cli_value: str | None, env: Mapping[str, str], env_var: str,
              config_value: str | None = None) -> str:
    """A device or backend request: the CLI flag, else the variable, else config, else auto."""
    for value in (cli_value, env.get(env_var), config_value):
        if value and value.strip():
            return value.strip().lower()
    return "auto"


def _validate_name(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise UserError(f"unknown {what} {value!r}: choose one of {', '.join(allowed)}")
    return value


def _implied_device(backend: str, host: HostDevices) -> str:
    if backend == "nccl":
        return "cuda"
    if backend in ("xccl", "ccl") and host.device_count("xpu") > 0:
        return "xpu"
    if backend == "xccl":
        return "xpu"
    return "cpu"


def _auto_device(host: HostDevices) -> str:
    for device_type in ("xpu", "cuda"):
        if host.device_count(device_type) > 0:
            return device_type
    return "cpu"


def _device_index(device_type: str, local_rank: int, local_world_size: int,
                  host: HostDevices, env: Mapping[str, str], wanted_by: str) -> int | None:
    if device_type == "cpu":
        return None
    count = host.device_count(device_type)
    if count == 0:
        hint = {"cuda": "a CUDA build of torch on a host with NVIDIA GPUs",
                "xpu": f"an Intel GPU, with {xpu_build(host.torch_version())} (docs/devices.md)"}[device_type]
        fallback = "--backend gloo" if wanted_by.startswith("backend") else "--device cpu"
        raise DeviceUnavailableError(
            f"{wanted_by} was requested but {host.describe_build()} sees no {device_type} "
            f"device on this host: use {fallback}, or run where there is {hint}")
    if count >= local_world_size:
        return local_rank
    visible_var = VISIBLE_DEVICE_VARS[device_type]
    if count == 1 and env.get(visible_var):
        # The scheduler or a wrapper gave each rank its own device through visible_var.
        return 0
    raise TooFewDevicesError(
        f"{local_world_size} ranks on this node but only {count} {device_type} device(s) "
        f"visible: start at most {count} ranks per node, or give each rank one device "
        f"through {visible_var}")


def select_device(device: str = "auto", backend: str = "auto", *, local_rank: int = 0,
                  local_world_size: int = 1, host: HostDevices | None = None,
                  env: Mapping[str, str] | None = None) -> DeviceChoice:
    """This rank's device and backend; ``DeviceUnavailableError`` if they cannot work."""
    host = torch_host(device, backend) if host is None else host
    env = os.environ if env is None else env
    device = _validate_name(device.lower(), DEVICE_TYPES, "device")
    backend = _validate_name(backend.lower(), BACKENDS, "backend")

    wanted_by = f"device '{device}'"
    if device == "auto":
        device = _auto_device(host) if backend == "auto" else _implied_device(backend, host)
        wanted_by = f"backend '{backend}'"
    if backend != "auto" and backend not in COMPATIBLE_BACKENDS[device]:
        raise DeviceUnavailableError(
            f"backend '{backend}' cannot communicate {device} tensors: with --device {device} "
            f"use {' or '.join(COMPATIBLE_BACKENDS[device])}")
    index = _device_index(device, local_rank, local_world_size, host, env, wanted_by)

    if backend == "auto":
        candidates = COMPATIBLE_BACKENDS[device]
        backend = next((b for b in candidates if host.backend_available(b)), candidates[0])
    if not host.backend_available(backend):
        raise DeviceUnavailableError(_missing_backend_message(backend, host))
    return DeviceChoice(device, backend, index)


def _missing_backend_message(backend: str, host: HostDevices) -> str:
    return f"backend '{backend}' is not available in {host.describe_build()}: {backend_advice(backend, host.torch_version())}"


def xpu_build(version: str) -> str:
    """How to get torch ``version``'s build for Intel GPUs."""
    return f"torch's XPU build (pip install torch=={version.split('+')[0]} --index-url {XPU_INDEX})"


def backend_advice(backend: str, version: str) -> str:
    """What makes ``backend`` available, for torch ``version``: something that works there."""
    release = parse(version)
    if backend == "xccl":
        if release < XCCL:
            return (f"torch's own xccl comes with its XPU build from torch {named(XCCL)}; with torch {version} "
                    "use --backend ccl with Intel's oneCCL bindings (docs/devices.md)")
        return f"install {xpu_build(version)}"
    if backend == "ccl":
        if release > IPEX_LAST:
            return (f"Intel's oneCCL bindings end at torch {named(IPEX_LAST)}; with torch {version} use --backend "
                    "xccl (torch's XPU build)")
        return (f"install Intel's oneCCL bindings built for torch {named(release)} (oneccl_bind_pt from Intel's "
                "index: docs/devices.md), or load the frameworks module on Aurora")
    return {"nccl": "NCCL ships only with CUDA builds of torch: use --backend gloo on CPU",
            "gloo": "this torch was built without gloo"}[backend]

"""Which process-group backends in-job recovery runs over (torch-free: the launch asks too,
before any rank starts)."""

from __future__ import annotations

from pathlib import Path

from ddp_hpc.contract import BACKEND_VAR
from ddp_hpc.device import CUDA_TRACES

#: The backends whose broken group a survivor can leave without exiting: gloo (its sockets
#: shut down) and nccl (its communicators aborted, ``fence.py``).
RECOVERABLE_BACKENDS = ("gloo", "nccl")


def backend_refusal(backend: str) -> str | None:
    """Why in-job recovery cannot run over ``backend`` (one line), or None."""
    if backend in RECOVERABLE_BACKENDS:
        return None
    return (f"in-job recovery runs over gloo and nccl, not {backend}: leaving a broken {backend} group without "
            f"ending the process (aborting its communicator and forming the group anew) is not built for Intel "
            f"GPUs yet; drop --recover and restart in place (--max-restarts), or train on CPU ranks over gloo "
            f"({BACKEND_VAR}=gloo)")


def host_refusal(backend: str, root: Path = Path("/")) -> str | None:
    """Why in-job recovery cannot run over ``backend`` with ranks on this host (one line),
    or None: nccl where the host shows no trace of an NVIDIA GPU nor of an AMD one (``CUDA_TRACES``:
    ROCm's /dev/kfd, where torch's ROCm build runs nccl as RCCL)."""
    if backend == "nccl" and not any(next(root.glob(pattern), None) for pattern in CUDA_TRACES):
        return ("nccl needs NVIDIA or AMD GPUs and this host shows none (no /dev/nvidia*, /proc/driver/nvidia/gpus, "
                f"/dev/kfd): give the backend gloo ({BACKEND_VAR}=gloo), or launch on the GPU nodes")
    return None

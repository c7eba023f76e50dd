"""Float32 matmuls and tensor cores: ``training.matmul_precision``, and the one-line hint
when a tensor-core GPU is left computing float32 matmuls at full precision.

torch's default (``highest``) keeps float32 matmuls off the tensor cores: on an H100 that is
the 67 TFLOP/s fp32 peak instead of TF32's 495 (``high``) or bf16's 990. The hint follows
Lightning's (``_check_cuda_matmul_precision``): a CUDA device of compute capability 8.0
(Ampere) or newer, at ``highest``; here only when nothing else uses the tensor cores
(no autocast, no FSDP2 bf16 compute).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

#: Compute capability from which NVIDIA GPUs run float32 matmuls on tensor cores (TF32).
TENSOR_CORE_CAPABILITY = (8, 0)

_hinted: set[str] = set()


def apply_matmul_precision(setting: str | None) -> None:
    """``torch.set_float32_matmul_precision(setting)``; None leaves torch's setting alone."""
    if setting is not None:
        torch.set_float32_matmul_precision(setting)


def tensor_core_hint(device_name: str, capability: tuple[int, int], matmul_precision: str,
                     lower_precision_compute: bool) -> str | None:
    """The hint's text for a CUDA device, or None where it has nothing to say."""
    if capability < TENSOR_CORE_CAPABILITY or matmul_precision != "highest" or lower_precision_compute:
        return None
    return (f"the CUDA device {device_name!r} has tensor cores that float32 matmuls at torch's 'highest' "
            f"precision leave unused: set training.matmul_precision: high (TF32) or medium, or "
            f"training.precision: bf16, to trade a little precision for several times the speed")


def log_tensor_core_hint(device: torch.device, lower_precision_compute: bool) -> None:
    """Log the hint once per process for ``device`` (call it on rank 0)."""
    if device.type != "cuda":
        return
    hint = tensor_core_hint(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                            torch.get_float32_matmul_precision(), lower_precision_compute)
    if hint is not None and hint not in _hinted:
        _hinted.add(hint)
        log.info(hint)

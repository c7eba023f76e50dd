"""Mixed precision: which autocast dtype, and whether a gradient scaler is needed."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from ddp_hpc.config_loader import ConfigError


@dataclass(frozen=True)
class Precision:
    device_type: str
    dtype: torch.dtype | None  # None: full precision, no autocast

    @property
    def needs_scaler(self) -> bool:
        return self.dtype == torch.float16

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self) -> AbstractContextManager:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device_type, enabled=self.needs_scaler)


def resolve_precision(setting: str, device_type: str) -> Precision:
    """``auto`` is bf16 on GPUs that support it (else fp16), full precision on CPU."""
    if setting == "auto":
        if device_type == "cuda":
            setting = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        elif device_type == "xpu":
            setting = "bf16"
        else:
            setting = "fp32"
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if setting not in dtypes:
        raise ConfigError(f"training.precision: unknown value {setting!r}")
    return Precision(device_type, dtypes[setting])

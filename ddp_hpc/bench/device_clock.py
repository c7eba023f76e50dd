"""Timing work on a device: wait for it before reading the clock, and the reference copy a
checkpoint's stall is held against (one copy of the same bytes to host memory)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs ahead of the Python that queued it)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def host_copy_baseline(tensors: Sequence[torch.Tensor], repeats: int = 3) -> dict[str, object]:
    """Seconds of one copy of ``tensors`` into host buffers kept from copy to copy (the
    first copy, which also faults the buffers' pages in, is not counted): from a CUDA device
    into pinned memory, as a background save's snapshot does; elsewhere into plain memory."""
    import torch

    device = tensors[0].device
    pinned = device.type == "cuda"
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    times = []
    for attempt in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor, non_blocking=pinned)
        synchronize(device)
        if attempt:
            times.append(time.perf_counter() - started)
    if pinned:
        what = "one pinned device-to-host copy of the same bytes"
    elif device.type == "cpu":
        what = "one host-to-host copy of the same bytes into a kept buffer (CPU ranks: no device-to-host copy here)"
    else:
        what = f"one {device.type}-to-host copy of the same bytes into a kept buffer (not pinned)"
    return {"copy_s": times, "copy_median_s": sorted(times)[len(times) // 2], "baseline": what,
            "bytes": sum(t.numel() * t.element_size() for t in tensors)}

"""Which torch versions ddp_hpc runs on, and what each can and cannot do: every gate on
torch's version in the package lives here.

Each gate is a pure function of a version string (``torch.__version__``), so tests pass
strings; callers pass ``installed()``. The supported range is pyproject.toml's
``torch>=2.5,<3``, whose lower bound CI installs and runs (docs/devices.md).
"""

from __future__ import annotations

import re

#: The lowest torch that CI proves; pyproject.toml's lower bound.
MINIMUM = (2, 5)
#: torch's libuv TCPStore server (the default from torch 2.4) refuses a listening socket
#: handed to it ("The libuv TCPStore backend does not support initialization with an listen
#: fd", a check in TCPStore.cpp's constructor) until pytorch/pytorch#150215 (2025-03-28,
#: after the 2.7 branch) added the missing uv_listen: first released in 2.8.0.
LIBUV_LISTEN_FD = (2, 8)
#: ddp_hpc's fsdp2 path (training/strategy.py): 2.5 has no ``torch.distributed.fsdp``
#: ``FSDPModule``/``MixedPrecisionPolicy``; 2.6 fails at the first step on CPU ('Stream'
#: object has no attribute 'record_event'); 2.7 leaves the root module unsharded after
#: evaluation, so the first checkpoint fails. 2.8 is the first that runs it through.
FSDP2 = (2, 8)
#: torch's own XPU collectives backend (``xccl``), in XPU builds of torch.
XCCL = (2, 8)
#: The last torch that Intel's extension (IPEX) and oneCCL bindings are released for.
IPEX_LAST = (2, 8)
#: ``torch.distributed.checkpoint.save``/``load`` take ``no_dist`` from 2.7; before, they
#: work it out themselves (no default group: no collectives), which is what we would pass.
DCP_NO_DIST = (2, 7)
#: ``dcp.async_save`` takes ``no_dist`` and ``async_stager`` (a stager kept between saves)
#: from 2.9; before, each save stages through a stager of its own.
DCP_ASYNC_STAGER = (2, 9)


def parse(version: str) -> tuple[int, int]:
    """``"2.5.1+cu121"`` -> ``(2, 5)``: the release a version string belongs to (a
    pre-release or source build such as ``"2.8.0a0+git1234"`` counts as its release)."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2])


def named(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))


def installed() -> str:
    """The running torch's version string."""
    import torch

    return str(torch.__version__)


def unsupported(version: str) -> str | None:
    """Why ddp_hpc does not run on torch ``version`` (one line), or None."""
    if parse(version) >= MINIMUM:
        return None
    return (f"ddp_hpc needs torch {named(MINIMUM)} or newer, and this is torch {version}: "
            f"install torch>={named(MINIMUM)} (docs/devices.md lists the versions CI runs)")


def libuv_takes_listen_fd(version: str) -> bool:
    """Whether torch's default (libuv) TCPStore server can serve on a socket we bound."""
    return parse(version) >= LIBUV_LISTEN_FD


def fsdp2_refusal(version: str) -> str | None:
    """Why ``training.strategy=fsdp2`` cannot run on torch ``version`` (one line), or None."""
    if parse(version) >= FSDP2:
        return None
    return (f"training.strategy=fsdp2 needs torch {named(FSDP2)} or newer, and this is torch {version}: "
            f"use training.strategy=ddp, or install torch>={named(FSDP2)}")


def dcp_takes_no_dist(version: str) -> bool:
    """Whether ``dcp.save``/``dcp.load`` take the ``no_dist`` keyword."""
    return parse(version) >= DCP_NO_DIST


def dcp_async_takes_stager(version: str) -> bool:
    """Whether ``dcp.async_save`` takes ``no_dist`` and ``async_stager``."""
    return parse(version) >= DCP_ASYNC_STAGER

"""Seeding and RNG state capture, in types ``torch.load(weights_only=True)`` accepts."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed this process's streams: Python's ``random``, numpy's global generator and torch's
    (the CPU's and every accelerator's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(base: int, step: int) -> int:
    """The seed of the streams after ``step`` steps of a rank whose base seed is ``base``:
    a hash, so that nearby bases and steps give unrelated streams (``base + step`` would
    make rank 1's step 0 rank 0's step 1)."""
    digest = hashlib.blake2b(f"{base}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: what every generator's seed takes


def seed_for_step(base: int, step: int) -> None:
    """Every stream as it is after ``step`` steps (``seed_everything(step_seed(base, step))``)."""
    seed_everything(step_seed(base, step))


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and accelerators), numpy, Python."""
    version, python_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        state["xpu"] = torch.xpu.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "xpu" in state and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.set_rng_state_all(state["xpu"])

"""A rank's state as one uint8 tensor, to send over a process group or keep in a file:
``torch.save`` into bytes, read back with ``torch.load(weights_only=True)`` (as every
checkpoint is read: tensors and plain data only, no code runs)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ddp_hpc.engine.recovery.errors import RecoveryError


#: The most bytes of a payload on a device at once while it travels over a group whose
#: tensors live there (NCCL): a payload goes in pieces of this size.
PIECE_BYTES = 256 << 20


def pieces(total: int) -> range:
    """Where each piece of a payload of ``total`` bytes starts."""
    return range(0, total, PIECE_BYTES)


def state_to_tensor(state: dict[str, Any]) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def state_from_tensor(payload: torch.Tensor) -> dict[str, Any]:
    from ddp_hpc.engine.checkpoint.files import unsupported_global

    try:
        # On the host: the objects' load_state_dict puts each tensor on its own device (the
        # sender's GPU index means nothing here).
        return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = unsupported_global(exc) or "unreadable"
        raise RecoveryError(f"the state from the survivors holds an object other than tensors and plain data "
                           f"({found}): it is read with torch.load(weights_only=True), as checkpoints are; give "
                           "the sampler, the Checkpointer's objects and extras plain state") from None



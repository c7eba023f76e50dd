"""Checkpoints the Trainer wrote before it was built on the ``Checkpointer`` (ddp_hpc up to
the Trainer split), brought into today's layout so that a run upgraded mid-way resumes.

Those checkpoints hold the same objects under the same names (model, optimizer,
scheduler, scaler, ema, history, early stopping, tracking, config) and each rank's RNG
streams in the same place, but no ``step`` and no ``sampler``: the Trainer kept its place
in the data order as ``progress`` (epoch, micro-batches done, epoch offset, global step)
and rebuilt the order from the config's seed and shuffle. The sampler's state is exactly
that, with the world size and per-rank batch of the run that wrote it, so the resume
continues with the same batches and the same RNG streams (bit-identically).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddp_hpc.engine.checkpoint.files import CheckpointError

#: The keys ``progress`` held before the split (and still holds).
PROGRESS_KEYS = ("epoch", "batches_done", "global_step", "epoch_offset")


def written_before_split(state: Mapping[str, Any]) -> bool:
    """A Trainer checkpoint of the layout before the split: progress, but no step and no sampler."""
    return "progress" in state and "step" not in state and "sampler" not in state


def upgrade_presplit(path: Path, state: dict[str, Any], dataset_len: int) -> dict[str, Any]:
    """``state`` in today's layout when it is a pre-split Trainer checkpoint (else unchanged).

    ``dataset_len``: this run's training set, which the old layout did not record (the
    job's name is checked against the checkpoint's next, as for any checkpoint).
    Refuses, in one line, a checkpoint whose data order cannot be rebuilt.
    """
    if not written_before_split(state):
        return state
    try:
        saved = {"epoch_offset": 0, **state["progress"]}  # no offset in files older than resharding
        progress = {key: int(saved[key]) for key in PROGRESS_KEYS}
        training, data = state["config"]["training"], state["config"]["data"]
        sampler = {
            "epoch": progress["epoch"],
            "batches_done": progress["batches_done"],
            "epoch_offset": progress["epoch_offset"],
            "world_size": int(state["world_size"]),
            "batch_size": int(training["batch_size"]),
            "seed": int(training["seed"]),
            "shuffle": bool(data["shuffle"]),
            "dataset_len": dataset_len,
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} was written before ddp_hpc's Trainer split and its place in "
                              f"the data order cannot be rebuilt ({type(exc).__name__}: {exc}); resume from "
                              "another checkpoint (checkpoint.resume=PATH) or start afresh") from None
    return {**state, "step": progress["global_step"], "sampler": sampler, "progress": progress}

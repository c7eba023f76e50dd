"""Print, as one JSON line per RUN_DIR argument, the final state of an examples/resumable_loop.py
run: step, sampler, and a SHA-256 over the bytes of the model's tensors, of the optimizer's
state and of each rank's torch RNG, from the newest checkpoint of either format.

For tests/test_stacks.py: run by the interpreter of the torch that wrote the checkpoints (a
newer torch's dcp metadata need not load in an older one), and two runs are bit-identical
when their lines are equal."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from ddp_hpc.engine.checkpoint.files import load_checkpoint, load_rank_part


def _digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    sha = hashlib.sha256()
    for name, value in tensors:
        tensor = torch.as_tensor(value).detach().cpu().contiguous()
        sha.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def final_state(folder: Path) -> dict:
    checkpoints = folder / "checkpoints"
    pointer = checkpoints / "last.dcp"
    if pointer.exists():
        from ddp_hpc.engine.checkpoint.dcp_read import check_complete, rank_key, read_blob, read_whole

        path = checkpoints / pointer.read_text().strip()
        state = read_whole(path)
        metadata = check_complete(path)
        ranks = [read_blob(path, metadata, rank_key(rank)) for rank in range(state["world_size"])]
        # dcp keys the optimizer's state by parameter name, the file format by index.
        names = state["optimizer"]["param_groups"][0]["params"]
        optimizer = {names.index(name): value for name, value in state["optimizer"]["state"].items()}
        form = "dcp"
    else:
        state = load_checkpoint(checkpoints / "last.pt")
        ranks = [load_rank_part(checkpoints, state["step"], rank) for rank in range(state["world_size"])]
        optimizer = state["optimizer"]["state"]
        form = "file"
    return {
        "format": form,
        "step": state["step"],
        "sampler": state["sampler"],
        "model": _digest(sorted(state["model"].items())),
        "optimizer": _digest([(f"{index}.{key}", value) for index in sorted(optimizer)
                              for key, value in sorted(optimizer[index].items())]),
        "rng": [_digest([("torch", part["rng"]["torch"])]) for part in ranks],
    }


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        print(json.dumps(final_state(Path(argument)), sort_keys=True))

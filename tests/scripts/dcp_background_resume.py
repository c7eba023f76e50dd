"""Background DCP saves of one rank, resumed bit-identical: ``python dcp_background_resume.py
FOLDER DEVICE STRATEGY...`` (DEVICE ``cpu`` or ``cuda``; STRATEGY ``ddp`` or ``fsdp2``, or
``fsdp2:file``: the same with ``format="file"``, saved in the foreground, FSDP2's whole state
gathered into one file and each rank's slice restored from it).

For each strategy: a small model with Adam state trains a few steps; ``Checkpointer(
format="dcp", background=True)`` saves at step 3 and again at step 5 (the second save
restages into the host buffers of the first), training goes on while each write runs; then
a fresh model and optimizer restore each checkpoint and must hold, bit for bit, the model
and optimizer state of its step. Prints ``resumed STRATEGY step N`` per checkpoint.
tests/test_stacks.py runs it on each torch version (CPU), tests/test_gpu.py on a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import ddp_hpc


def build(strategy: str, device: torch.device, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, steps: int) -> None:
    for _ in range(steps):
        inputs = torch.randn(8, 16, device=device)
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model's and the optimizer's state, this rank's part, on the host."""
    flat: dict[str, torch.Tensor] = {}

    def visit(value, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{key}.{k}")
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            flat[key] = local.detach().to("cpu", copy=True)

    visit(get_model_state_dict(model), "model")
    visit(get_optimizer_state_dict(model, optimizer), "optimizer")
    return flat


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def run(folder: Path, device: torch.device, name: str) -> None:
    strategy, _, checkpoint_format = name.partition(":")
    checkpoint_format = checkpoint_format or "dcp"
    model, optimizer = build(strategy, device, seed=0)
    checkpointer = ddp_hpc.Checkpointer(folder, {"model": model, "optimizer": optimizer},
                                        background=checkpoint_format == "dcp", format=checkpoint_format, keep_last=3)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    for steps in (3, 2):
        train(model, optimizer, device, steps)
        for _ in range(steps):
            checkpointer.step_done(save=False)
        checkpointer.save()
        expected[checkpointer.step] = state(model, optimizer)
        train(model, optimizer, device, 2)  # the live state moves on while the write runs
    checkpointer.wait()
    assert not same(expected[3], expected[5]), "steps 3 and 5 hold the same state: the test proves nothing"
    for step, wanted in expected.items():
        fresh, fresh_optimizer = build(strategy, device, seed=1)
        train(fresh, fresh_optimizer, device, 1)  # Adam state of its own, to be replaced
        restorer = ddp_hpc.Checkpointer(folder, {"model": fresh, "optimizer": fresh_optimizer},
                                        format=checkpoint_format)
        restorer.restore(folder / "checkpoints" / f"step-{step:08d}{'.pt' if checkpoint_format == 'file' else ''}")
        got = state(fresh, fresh_optimizer)
        if not same(got, wanted):
            differ = sorted(k for k in wanted if k not in got or not torch.equal(got[k], wanted[k]))
            sys.exit(f"{name}: the checkpoint of step {step} does not hold that step's state: {differ}")
        print(f"resumed {name} step {step}", flush=True)


def main() -> None:
    folder, device_name, *strategies = sys.argv[1:]
    device = torch.device(device_name if device_name == "cpu" else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{folder}/.group",
                            rank=0, world_size=1)
    try:
        for strategy in strategies:
            run(Path(folder) / strategy.replace(":", "-"), device, strategy)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

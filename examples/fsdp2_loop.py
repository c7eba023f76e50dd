"""examples/resumable_loop.py with the model sharded by FSDP2 (torch's ``fully_shard``)
instead of wrapped in DDP: each rank holds 1/N of every parameter and of Adam's state, and
the checkpoints are sharded too (``format="dcp"``: every rank writes its own part, in
parallel; a checkpoint written by N ranks resumes on any other number). Everything else
(resume mid-epoch, the agreed stop with exit 75, the watchdog) is as in resumable_loop.py.

    torchrun --nproc_per_node 2 examples/fsdp2_loop.py
    ddp-hpc launch --launcher mpich --nproc 2 --max-restarts 1 -- python examples/fsdp2_loop.py
"""

import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import ddp_hpc


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()

    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    targets = torch.tensor(digits.target)
    train = TensorDataset(inputs[:1500], targets[:1500])
    test_inputs, test_targets = inputs[1500:].to(device), targets[1500:].to(device)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)  # a unit of its own: its parameters are gathered only while it runs
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)  # built on the shards: state for them only
    sampler = ddp_hpc.ResumableSampler(train, shuffle=True, seed=0, batch_size=32)
    loader = DataLoader(train, batch_size=32, sampler=sampler, generator=torch.Generator())
    checkpointer = ddp_hpc.Checkpointer(os.environ.get("RUN_DIR", "runs/fsdp2_loop"),
                                        {"model": model, "optimizer": optimizer, "sampler": sampler},
                                        every_n_steps=10, format="dcp")
    stop = ddp_hpc.StopAgreement(checkpointer)
    stop.handle_signals()  # SIGUSR2, SIGTERM: checkpoint and stop at the next step
    checkpointer.restore()
    with ddp_hpc.watchdog(limit_s=300) as watchdog:
        for epoch in range(sampler.epoch, 5):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                optimizer.step()
                checkpointer.step_done()
                watchdog.beat()
                if stop.now():
                    break
            if stop.stopped:
                break
    checkpointer.save(wait=True)  # the final state, on disk before the process exits

    with torch.no_grad():  # every rank runs the whole test set: each forward gathers the shards
        accuracy = (model(test_inputs).argmax(1) == test_targets).float().mean()
    held = sum(p.to_local().numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    print(f"rank {rank}/{world_size}: holds {held} of {whole} parameters; test_accuracy={accuracy:.4f}\n",
          end="", flush=True)
    del model, optimizer
    dist.destroy_process_group()
    raise SystemExit(stop.exit_status)  # 75 after a stop: the scheduler requeues, the next run resumes


if __name__ == "__main__":
    main()

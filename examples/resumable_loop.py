"""examples/plain_ddp.py plus ddp_hpc's parts for a loop of one's own (docs/api.md,
"Your own loop", shows the difference): checkpoints every 10 steps in $RUN_DIR (default
runs/resumable_loop), a restart resumes bit-identically from the newest one (mid-epoch
too, on another world size too), SIGUSR2/SIGTERM or the job's deadline stop every rank at
the same step with a checkpoint and exit 75 (requeue), and a watchdog ends a stuck rank.

    torchrun --nproc_per_node 2 examples/resumable_loop.py
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node 2 --max-restarts 1 examples/resumable_loop.py
    ddp-hpc launch --launcher mpich --nproc 2 --max-restarts 1 -- python examples/resumable_loop.py
    mpiexec -n 4 ddp-hpc run -- python examples/resumable_loop.py
"""

import gc
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
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
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    sampler = ddp_hpc.ResumableSampler(train, shuffle=True, seed=0, batch_size=32)
    loader = DataLoader(train, batch_size=32, sampler=sampler, generator=torch.Generator())
    checkpointer = ddp_hpc.Checkpointer(os.environ.get("RUN_DIR", "runs/resumable_loop"),
                                        {"model": model, "optimizer": optimizer, "sampler": sampler}, every_n_steps=10)
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

    with torch.no_grad():  # each rank scores its share of the test set; all_reduce sums
        mine = slice(rank, None, world_size)
        correct = (model(test_inputs[mine]).argmax(1) == test_targets[mine]).sum()
    counts = torch.stack([correct, torch.tensor(len(test_targets[mine]), device=device)]).float()
    dist.all_reduce(counts)
    line = (f"rank {rank}/{world_size} local_rank {local_rank}: all_reduce correct={int(counts[0])} "
            f"total={int(counts[1])} test_accuracy={counts[0] / counts[1]:.4f}")
    # One write per line: the ranks share the launcher's output, and print() writes the
    # newline separately, so two ranks' lines could merge.
    print(line + "\n", end="", flush=True)
    # Free DDP (it sits in a reference cycle) while the group is alive: with gloo, a
    # DistributedDataParallel that outlives destroy_process_group can abort the process at exit.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    raise SystemExit(stop.exit_status)  # 75 after a stop: the scheduler requeues, the next run resumes


if __name__ == "__main__":
    main()

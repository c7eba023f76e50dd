"""The same script as plain_ddp.py, using ddp_hpc's API instead of torchrun's variables.

It runs under any launcher with no wrapper (torchrun, mpiexec of any MPI, srun, one plain
process) because ddp_hpc resolves the rank from the launcher and picks the device:

    mpiexec -n 4 python examples/with_api.py
    srun -N2 -n4 python examples/with_api.py
    python examples/with_api.py
"""

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_hpc


def main() -> None:
    with ddp_hpc.process_group() as ctx:  # resolve the rank, pick device + backend, init
        rank, world_size, device = ctx.rank, ctx.world_size, ctx.torch_device

        digits = load_digits()
        inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        targets = torch.tensor(digits.target)
        train = TensorDataset(inputs[:1500], targets[:1500])
        test_inputs, test_targets = inputs[1500:].to(device), targets[1500:].to(device)

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
        if ctx.group_initialized:
            model = DDP(model, device_ids=ctx.device.ddp_device_ids)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(train, batch_size=32, sampler=sampler)
        for epoch in range(5):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                optimizer.step()

        with torch.no_grad():
            mine = slice(rank, None, world_size)
            correct = (model(test_inputs[mine]).argmax(1) == test_targets[mine]).sum().item()
        total_correct, total = ctx.all_reduce([correct, len(test_targets[mine])])  # sum over ranks
        line = (f"rank {rank}/{world_size} local_rank {ctx.local_rank}: all_reduce correct={int(total_correct)} "
                f"total={int(total)} test_accuracy={total_correct / total:.4f}")
        # One write per line: the ranks share the launcher's output, and print() writes the
        # newline separately, so two ranks' lines could merge.
        print(line + "\n", end="", flush=True)


if __name__ == "__main__":
    main()

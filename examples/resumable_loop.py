"""A training loop of one's own with ddp_hpc's parts (docs/api.md, "Your own loop", shows it
whole): checkpoints every 10 steps in $RUN_DIR (default runs/resumable_loop), a restart
resumes bit-identically from the newest one (mid-epoch too, on another world size too, the
learning-rate schedule re-planned), SIGUSR2/SIGTERM or the job's deadline stop every rank
at the same step with a checkpoint and exit 75 (requeue), and a watchdog ends a stuck rank.
The same file runs as one plain process and under any launcher:

    python examples/resumable_loop.py
    torchrun --nproc_per_node 2 examples/resumable_loop.py
    mpiexec -n 4 python examples/resumable_loop.py
    srun -N 2 -n 4 python examples/resumable_loop.py
    ddp-hpc launch --launcher mpich --nproc 2 --max-restarts 1 -- python examples/resumable_loop.py
"""

import ddp_hpc

# First, before the heavy imports and the rendezvous: a stop signal (SIGUSR2) that comes
# before stop.handle_signals() is recorded, and the run stops at its first step.
ddp_hpc.record_stop_signals()

import logging  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

EPOCHS = 5


def main() -> None:
    # ddp_hpc logs through the logging module and configures nothing: shown here are its
    # warnings and, at INFO, rank 0's "resuming from PATH (step N)".
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
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
        sampler = ddp_hpc.ResumableSampler(train, shuffle=True, seed=0, batch_size=32)
        loader = DataLoader(train, batch_size=32, sampler=sampler, generator=torch.Generator())
        steps_per_epoch = len(loader)  # a whole epoch on this world size
        checkpointer = ddp_hpc.Checkpointer(os.environ.get("RUN_DIR", "runs/resumable_loop"),
                                            {"model": model, "optimizer": optimizer, "sampler": sampler},
                                            every_n_steps=10)
        stop = ddp_hpc.StopAgreement(checkpointer)
        stop.handle_signals()  # SIGUSR2, SIGTERM: checkpoint and stop at the next step
        checkpointer.restore()
        # The schedule spans the steps this run has left, planned after the restore: on another
        # world size an epoch has another number of steps (len(loader): the rest of this one).
        steps_left = len(loader) + (EPOCHS - 1 - sampler.epoch) * steps_per_epoch
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=checkpointer.step
                                                        + steps_left, last_epoch=checkpointer.step - 1)
        with ddp_hpc.watchdog(limit_s=300) as watchdog:
            for epoch in range(sampler.epoch, EPOCHS):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                    optimizer.step()
                    scheduler.step()
                    checkpointer.step_done()
                    watchdog.beat()
                    if stop.now():
                        break
                if stop.stopped:
                    break
        checkpointer.save(wait=True)  # the final state, on disk before the process exits

        with torch.no_grad():  # each rank scores its share of the test set; all_reduce sums
            mine = slice(rank, None, world_size)
            correct = (model(test_inputs[mine]).argmax(1) == test_targets[mine]).sum().item()
        total_correct, total = ctx.all_reduce([correct, len(test_targets[mine])])
        line = (f"rank {rank}/{world_size} local_rank {ctx.local_rank}: all_reduce correct={int(total_correct)} "
                f"total={int(total)} test_accuracy={total_correct / total:.4f}")
        # One write per line: the ranks share the launcher's output, and print() writes the
        # newline separately, so two ranks' lines could merge.
        print(line + "\n", end="", flush=True)
        status = stop.exit_status
        # Let DDP go while the group is alive (process_group collects before it ends the
        # group): with gloo, a DDP model that outlives the group can abort the process at exit.
        del model, optimizer, scheduler, checkpointer, stop
    raise SystemExit(status)  # 75 after a stop: the scheduler requeues, the next run resumes


if __name__ == "__main__":
    main()

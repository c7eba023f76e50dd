"""examples/resumable_loop.py's parts with in-job recovery: a lost or frozen rank is replaced
while the others stay up, and training goes on from the survivors' memory (no checkpoint
read, no restart); the checkpoints and the agreed stop go on as before.

    ddp-hpc launch --nproc 4 --recover 2 -- python examples/recovering_loop.py
    ddp-hpc launch --nproc 4 --recover 1 --shrink -- python examples/recovering_loop.py

Kill one rank (``kill -9``) or freeze it (``kill -STOP``) while it trains: the launch starts
a replacement, every rank continues at the step that failed. Under any other launcher it
trains as plain DDP and a failure ends the job (the launcher's restart resumes from the
newest checkpoint). SIGUSR2/SIGTERM stop every rank at the same step with a checkpoint (exit 75).

Settings (environment): RUN_DIR (default runs/recovering_loop: checkpoints every 5 steps,
recoveries in its record/), EPOCHS (default 3), STEP_DELAY_S (a pause after each step, to
watch it), STOP_AT_STEP (the rank in slot 3 requests a stop after that step, as a signal would),
DEVICE (cpu, the default, or cuda: each rank on cuda:LOCAL_RANK, or on one GPU shared by
every rank where there are fewer GPUs than ranks, over gloo), BACKEND (gloo, the default, or
nccl: one GPU per rank, DEVICE=cuda).
At the end each rank writes RUN_DIR/final/rank-<N>.pt (weights, optimizer state, RNG
streams, step, the checkpoint it resumed from) and RUN_DIR/samples/rank-<N>.txt (a line a
step: pid, group generation, step, sample ids).
"""

import ddp_hpc

ddp_hpc.record_stop_signals()  # before the heavy imports: a stop that comes early is kept

import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ddp_hpc.engine.rng import capture_rng  # noqa: E402


def main() -> None:
    run_dir = Path(os.environ.get("RUN_DIR", "runs/recovering_loop"))
    epochs, delay = int(os.environ.get("EPOCHS", "3")), float(os.environ.get("STEP_DELAY_S", "0"))
    stop_at = int(os.environ.get("STOP_AT_STEP", "0"))
    # What needs no rank first: a warm spare (--warm-spare) has it done when it takes a rank's place.
    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    train_set = TensorDataset(inputs[:1500], torch.tensor(digits.target[:1500]), torch.arange(1500))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    # In place of dist.init_process_group (over nccl it binds this rank's GPU, cuda:LOCAL_RANK).
    recovery = ddp_hpc.InJobRecovery(os.environ.get("BACKEND", "gloo"), run_dir=run_dir)
    slot = recovery.slot  # this rank's place in the launch (its rank in the group may change after a shrink)
    ddp_hpc.seed_everything(1000 + slot)  # each rank's own streams (torch, numpy, Python): its own dropout
    device = torch.device(os.environ.get("DEVICE", "cpu"))
    if device.type == "cuda":  # LOCAL_RANK is this rank's once InJobRecovery returned (a warm spare's too)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model.to(device)  # in place: the optimizer keeps its parameters
    sampler = ddp_hpc.ResumableSampler(train_set, shuffle=True, seed=0, batch_size=32)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler, generator=torch.Generator())
    checkpointer = ddp_hpc.Checkpointer(run_dir, {"model": model, "optimizer": optimizer, "sampler": sampler},
                                        every_n_steps=5)
    stop = ddp_hpc.StopAgreement(checkpointer)
    stop.handle_signals()
    if not recovery.joining:  # a replacement takes its state from the survivors
        checkpointer.restore()
    (run_dir / "samples").mkdir(parents=True, exist_ok=True)
    samples = (run_dir / "samples" / f"rank-{slot}.txt").open("a")

    def train(ddp_model: nn.Module) -> None:
        # Called again after a recovery: it goes on from the sampler's position.
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for x, y, ids in loader:
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                nn.functional.cross_entropy(ddp_model(x), y).backward()  # dropout draws from the RNG
                optimizer.step()
                recovery.step_done()  # the same as checkpointer.step_done(): counts, saves every 5 steps
                samples.write(f"{os.getpid()} {recovery.generation} {recovery.step} {' '.join(map(str, ids.tolist()))}\n")
                samples.flush()
                if slot == 3 and recovery.step == stop_at:
                    stop.request()
                if stop.now():
                    return
                time.sleep(delay)

    recovery.run(train, model=model, optimizer=optimizer, sampler=sampler, checkpointer=checkpointer,
                 stop=stop)
    checkpointer.save(wait=True)
    (run_dir / "final").mkdir(exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": capture_rng(),
                "step": recovery.step, "world_size": dist.get_world_size(), "pid": os.getpid(),
                "recoveries": len(recovery.recoveries),
                "resumed": str(checkpointer.resumed.path) if checkpointer.resumed else None},
               run_dir / "final" / f"rank-{slot}.pt")
    print(f"rank {slot}: step {recovery.step}, {len(recovery.recoveries)} recoveries\n", end="", flush=True)
    recovery.close()
    sys.exit(stop.exit_status)


if __name__ == "__main__":
    main()

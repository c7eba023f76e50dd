"""examples/plain_ddp.py with in-job recovery: a lost or frozen rank is replaced while the
others stay up, and training goes on from the survivors' memory (no checkpoint, no restart).

    ddp-hpc launch --nproc 4 --recover 2 -- python examples/recovering_loop.py
    ddp-hpc launch --nproc 4 --recover 1 --shrink -- python examples/recovering_loop.py

Kill one rank (``kill -9``) or freeze it (``kill -STOP``) while it trains: the launch starts
a replacement, every rank continues at the step that failed. Under any other launcher it
trains as plain DDP and a failure ends the job (the launcher's restart takes over).

Settings (environment): RUN_DIR (default runs/recovering_loop; recoveries are recorded in
its record/), EPOCHS (default 3), STEP_DELAY_S (a pause after each step, to watch it).
At the end each rank writes RUN_DIR/final/rank-<N>.pt (weights, optimizer state, RNG
streams, step) and RUN_DIR/samples/rank-<N>.txt (a line a step: pid, group generation, step, sample ids).
"""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_hpc
from ddp_hpc.engine.rng import capture_rng, seed_everything


def main() -> None:
    run_dir = Path(os.environ.get("RUN_DIR", "runs/recovering_loop"))
    epochs, delay = int(os.environ.get("EPOCHS", "3")), float(os.environ.get("STEP_DELAY_S", "0"))
    recovery = ddp_hpc.InJobRecovery("gloo", run_dir=run_dir)  # in place of dist.init_process_group
    slot = recovery.slot  # this rank's place in the launch (its rank may change after a shrink)

    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    train_set = TensorDataset(inputs[:1500], torch.tensor(digits.target[:1500]), torch.arange(1500))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    seed_everything(1000 + slot)  # each rank's own streams (torch, numpy, Python): its own dropout
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    sampler = ddp_hpc.ResumableSampler(train_set, shuffle=True, seed=0, batch_size=32)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler, generator=torch.Generator())
    (run_dir / "samples").mkdir(parents=True, exist_ok=True)
    samples = (run_dir / "samples" / f"rank-{slot}.txt").open("a")

    def train(ddp_model: nn.Module) -> None:
        # Called again after a recovery: it goes on from the sampler's position.
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for x, y, ids in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(ddp_model(x), y).backward()  # dropout draws from the RNG
                optimizer.step()
                recovery.step_done()
                samples.write(f"{os.getpid()} {recovery.generation} {recovery.step} {' '.join(map(str, ids.tolist()))}\n")
                samples.flush()
                time.sleep(delay)

    recovery.run(train, model=model, optimizer=optimizer, sampler=sampler)
    (run_dir / "final").mkdir(exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": capture_rng(),
                "step": recovery.step, "world_size": dist.get_world_size(), "pid": os.getpid(),
                "recoveries": len(recovery.recoveries)}, run_dir / "final" / f"rank-{slot}.pt")
    print(f"rank {slot}: step {recovery.step}, {len(recovery.recoveries)} recoveries\n", end="", flush=True)
    recovery.close()


if __name__ == "__main__":
    main()

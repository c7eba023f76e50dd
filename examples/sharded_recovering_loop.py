"""examples/recovering_loop.py with the model sharded by FSDP2: a lost rank is replaced in
the job and its shards come back from a buddy's snapshot in node-local memory.

    ddp-hpc launch --nproc 4 --recover 2 -- python examples/sharded_recovering_loop.py

Every ``SNAPSHOT_EVERY`` steps (default 1) each rank copies its shards, optimizer state,
sampler position and RNG base to node-local memory (``/dev/shm``) and to a buddy rank
``LOCAL_WORLD_SIZE`` ranks away (another host). Kill one rank (``kill -9``) or a whole host's
ranks: the survivors go back to the newest snapshot every shard has, a replacement takes the
lost shards from its buddy's copy, and the steps since are done again; no checkpoint is read.
When the launch gives up (more losses than ``--recover`` allows) and restarts in place
(``--max-restarts``), the restarted ranks read the snapshots the nodes kept where they are
newer than the checkpoint on disk (``RUN_DIR/record/resume-<N>.json`` says which).

Settings (environment): RUN_DIR (default runs/sharded_recovering_loop), CHECKPOINT_EVERY
(steps between dcp checkpoints, default 10), EPOCHS (default 2), SNAPSHOT_EVERY, STEP_DELAY_S
(a pause after each step), BACKEND (gloo, the default, on CPU; or nccl: each rank on its own
GPU, cuda:LOCAL_RANK). At
the end each rank writes RUN_DIR/final/rank-<N>.pt: its shards (local parts), its
optimizer state's, the step, the number of recoveries, its pid and the checkpoint it
resumed from (none where nothing came from disk).
"""

import ddp_hpc

ddp_hpc.record_stop_signals()

import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402, F401  # the dcp Checkpointer's: imported before a spare waits
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def local(tree):
    """Each DTensor's local shard (what this rank holds), for the final file."""
    if hasattr(tree, "to_local"):
        return tree.to_local().detach().clone()
    if isinstance(tree, dict):
        return {k: local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local(v) for v in tree]
    return tree


def main() -> None:
    run_dir = Path(os.environ.get("RUN_DIR", "runs/sharded_recovering_loop"))
    epochs, delay = int(os.environ.get("EPOCHS", "2")), float(os.environ.get("STEP_DELAY_S", "0"))
    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    train_set = TensorDataset(inputs[:1500], torch.tensor(digits.target[:1500]))

    backend = os.environ.get("BACKEND", "gloo")
    # In place of dist.init_process_group (over nccl it binds this rank's GPU, cuda:LOCAL_RANK).
    recovery = ddp_hpc.InJobRecovery(backend, run_dir=run_dir, snapshot_every=int(os.environ.get("SNAPSHOT_EVERY", "1")))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    ddp_hpc.seed_everything(1000 + recovery.slot)  # each rank's own streams (its own dropout)
    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10)).to(device)
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)  # over every rank of the group InJobRecovery formed
    ddp_hpc.seed_everything(1000 + recovery.slot)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = ddp_hpc.ResumableSampler(train_set, shuffle=True, seed=0, batch_size=32)
    # A generator of its own: a new iterator (after a recovery) draws no number from the streams dropout uses.
    loader = DataLoader(train_set, batch_size=32, sampler=sampler, generator=torch.Generator())
    checkpointer = ddp_hpc.Checkpointer(run_dir, {"model": model, "optimizer": optimizer, "sampler": sampler},
                                        every_n_steps=int(os.environ.get("CHECKPOINT_EVERY", "10")), format="dcp")
    stop = ddp_hpc.StopAgreement(checkpointer)
    stop.handle_signals()
    if not recovery.joining:  # a replacement takes its shards from a buddy's snapshot
        checkpointer.restore()

    def train(sharded: nn.Module) -> None:
        # Called again after a recovery: it goes on from the sampler's position.
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(sharded(x.to(device)), y.to(device)).backward()
                optimizer.step()
                recovery.step_done()  # counts, snapshots, saves every 10 steps
                if stop.now():
                    return
                time.sleep(delay)

    recovery.run(train, model=model, optimizer=optimizer, sampler=sampler, checkpointer=checkpointer, stop=stop)
    checkpointer.save(wait=True)
    (run_dir / "final").mkdir(exist_ok=True)
    torch.save({"model": local(model.state_dict()), "optimizer": local(optimizer.state_dict()),
                "step": recovery.step, "recoveries": len(recovery.recoveries), "pid": os.getpid(),
                "resumed": str(checkpointer.resumed.path) if checkpointer.resumed else None},
               run_dir / "final" / f"rank-{recovery.slot}.pt")
    print(f"rank {recovery.slot}: step {recovery.step}, {len(recovery.recoveries)} recoveries\n", end="", flush=True)
    recovery.close()
    sys.exit(stop.exit_status)


if __name__ == "__main__":
    main()

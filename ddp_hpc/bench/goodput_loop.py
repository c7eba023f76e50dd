"""The training loop of ``ddp-hpc bench goodput``: one script for every arm.

It checkpoints every ``--checkpoint-every`` steps (``Checkpointer``, as
examples/resumable_loop.py) and starts its group with ``InJobRecovery``: under
``ddp-hpc launch --recover`` a lost rank is recovered in the job, under ``--max-restarts``
(or a new launch) every rank starts again and resumes from the newest checkpoint. The work
per step and the checkpoint cadence are the same in both; only the launch differs. Under a
launch without recovery a ``watchdog`` ends a rank whose peer went silent (a hung rank),
with the limit the harness gives as ``--hang-timeout`` (under ``--recover`` the launch's
own heartbeat check does that, and a watchdog would end the survivors while they wait for
the replacement).

With ``--fsdp2`` the model is sharded (``fully_shard``, every rank holds a quarter of it on
4 ranks), the checkpoints are sharded (``dcp``), and under ``--recover`` each rank's shards
are snapshotted every ``--snapshot-every`` steps into node-local memory and a buddy's
(``InJobRecovery(snapshot_every=...)``): a lost rank's replacement takes its shards from a
buddy, the survivors roll back to the newest snapshot every shard has.

Each rank appends one line per event to ``RUN_DIR/steps/rank-<slot>.log`` (one write per
line, ``time.time()`` stamps), which ``bench/goodput.py`` reads:

    start PID LAUNCH ATTEMPT T                  the process started (before torch is imported)
    group PID LAUNCH ATTEMPT GENERATION T       its first process group formed
    restored PID LAUNCH ATTEMPT STEP T          the checkpoint restore ended (STEP 0: nothing saved yet)
    step PID LAUNCH ATTEMPT GENERATION STEP T0 T1   a step completed: T0 the end of the previous
                                                step on this rank (or the loop's start), T1 its
                                                end, the checkpoint save (if due) excluded
"""

import time

STARTED = time.time()

import argparse  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402


class StepLog:
    """This rank's event lines, one ``write`` each (the harness reads them while they grow)."""

    def __init__(self, path: Path, launch: int, attempt: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._who = f"{os.getpid()} {launch} {attempt}"

    def write(self, kind: str, *fields: object) -> None:
        os.write(self._fd, (" ".join([kind, self._who, *map(str, fields)]) + "\n").encode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--input-dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--step-work", type=float, default=0.0,
                        help="seconds of the loop's own work after each optimizer step, before step_done")
    parser.add_argument("--fsdp2", action="store_true", help="shard the model (fully_shard) and the checkpoints (dcp)")
    parser.add_argument("--snapshot-every", type=int, default=1,
                        help="with --fsdp2 under --recover: steps between snapshots")
    args = parser.parse_args(argv)

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_hpc.contract import RESTART_COUNT_VAR
    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.rng import seed_everything
    from ddp_hpc.engine.sampler import ResumableSampler
    from ddp_hpc.engine.watchdog import watchdog

    run_dir = Path(args.run_dir)
    launch, attempt = int(os.environ.get("GOODPUT_LAUNCH", "0")), int(os.environ.get(RESTART_COUNT_VAR, "0"))
    # The set-up that needs no rank comes before InJobRecovery: a warm spare has done it
    # when it is given a lost rank's place.
    data = torch.Generator().manual_seed(0)
    inputs = torch.randn(args.samples, args.input_dim, generator=data)
    targets = torch.randint(0, 10, (args.samples,), generator=data)
    train_set = TensorDataset(inputs, targets)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.input_dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 10))
    # A sharded model's optimizer is made after fully_shard (its parameters become DTensors).
    optimizer = None if args.fsdp2 else torch.optim.Adam(model.parameters(), lr=1e-4)
    if args.fsdp2:  # what the dcp Checkpointer imports (0.7 s here): on a replacement's critical path otherwise
        import torch.distributed.checkpoint  # noqa: F401

    recovery = InJobRecovery("gloo", run_dir=run_dir, snapshot_every=args.snapshot_every if args.fsdp2 else None)
    if args.fsdp2:  # over the group InJobRecovery formed (a warm spare has none before it)
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    log = StepLog(run_dir / "steps" / f"rank-{recovery.slot}.log", launch, attempt)
    log.write("start", STARTED)
    log.write("group", recovery.generation, time.time())
    seed_everything(1000 + recovery.slot)
    sampler = ResumableSampler(train_set, shuffle=True, seed=0, batch_size=args.batch)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, generator=torch.Generator())
    # recovery.step_done is the Checkpointer's step_done too; a save's start marks the step's end.
    save_started: list[float] = []
    checkpointer = Checkpointer(run_dir, {"model": model, "optimizer": optimizer, "sampler": sampler},
                                every_n_steps=args.checkpoint_every, keep_last=2,
                                format="dcp" if args.fsdp2 else "file",
                                on_saving=lambda: save_started.append(time.time()))
    if not recovery.joining:  # a replacement takes the state from a survivor (or a buddy's snapshot), not from disk
        checkpointer.restore(quiet=True)
        log.write("restored", checkpointer.step, time.time())

    def train(ddp_model: nn.Module) -> None:
        # Called again after an in-job recovery: it goes on from the sampler's position.
        previous = time.time()
        for epoch in range(sampler.epoch, 1_000_000):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(ddp_model(x), y).backward()
                optimizer.step()
                if args.step_work:  # the loop's own work (logging, metrics) between the step and step_done
                    time.sleep(args.step_work)
                save_started.clear()
                recovery.step_done()  # counts, moves the sampler on, saves at the cadence
                ended = save_started[0] if save_started else time.time()  # the save excluded
                log.write("step", recovery.generation, recovery.step, previous, ended)
                dog.beat()
                previous = time.time()

    if recovery.enabled:
        dog = _NoWatchdog()
        recovery.run(train, model=model, optimizer=optimizer, sampler=sampler, checkpointer=checkpointer)
    else:
        with watchdog(limit_s=args.hang_timeout) as dog:
            recovery.run(train, model=model, optimizer=optimizer, sampler=sampler, checkpointer=checkpointer)


class _NoWatchdog:
    def beat(self) -> None:
        pass


if __name__ == "__main__":
    main()

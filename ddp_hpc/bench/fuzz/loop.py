"""One rank of a recovery case: ``python -m ddp_hpc.bench.fuzz.loop CASE.json``, under
``ddp-hpc launch --recover``; the runner (``runner.py``) starts it.

It builds the case's model (``cases.Shape``) and trains it with ``InJobRecovery`` the way
docs/api.md shows a loop of one's own, and puts the case's faults in itself: the rank in a
fault's slot sends the fault's signal to itself at the drawn moment (hooks on the drawn
submodule, an optimizer step pre-hook, the loop's own window, and wrappers around the
snapshot, the checkpoint save and the replacement's transfer, installed in this process
only), once per run: a file ``RUN_DIR/fault-<index>-slot-<slot>`` says it fired, so a
redone step or a restart in place runs clean. At the end each rank writes
``RUN_DIR/final/rank-<slot>.pt``: ``state`` (what must be bit-identical: model and optimizer
state with DTensors as their local shards, scheduler, step, sampler, RNG streams) and
``meta`` (pid, generation, restarts, recoveries).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ddp_hpc.bench.fuzz.cases import Block, Case, Fault, Shape
from ddp_hpc.contract import FUZZ_DEVICE_VAR

#: Marker files of the faults that fired, in the run folder.
FIRED_PREFIX = "fault-"


class Faults:
    """The case's faults this process may fire: each once per run folder."""

    def __init__(self, case: Case, slot: int, generation: int, run_dir: Path) -> None:
        self.slot, self.generation, self.run_dir = slot, generation, run_dir
        self.mine = [(index, fault) for index, fault in enumerate(case.faults)
                     if slot in fault.slots and (generation > 0 or not fault.replacement)]
        #: The micro-batch being done (the loop sets it), and the steps completed (``recovery.step``).
        self.micro = 0
        self.completed = lambda: 0

    def at(self, moment: str, *, step: int | None = None, module: str | None = None, sub: str = "") -> None:
        """Fire every fault of this slot due at ``moment`` of ``step`` (default: the step being done)."""
        step = self.completed() + 1 if step is None else step
        for index, fault in self.mine:
            if fault.moment != moment or (fault.moment not in ("appear", "transfer") and fault.step != step):
                continue
            if module is not None and (fault.module != module or fault.micro != self.micro):
                continue
            if fault.sub and fault.sub != sub:
                continue
            self._fire(index, fault, step)

    def _fire(self, index: int, fault: Fault, step: int) -> None:
        marker = self.run_dir / f"{FIRED_PREFIX}{index}-slot-{self.slot}"
        self.run_dir.mkdir(parents=True, exist_ok=True)  # nothing may have written the run folder yet
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.write(fd, f"{os.getpid()} {self.generation} {step} {fault.summary()}\n".encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL if fault.signal == "KILL" else signal.SIGSTOP)


def build_model(shape: Shape) -> Any:
    import torch
    from torch import nn

    class FuzzBlock(nn.Module):
        def __init__(self, spec: Block, hidden: int) -> None:
            super().__init__()
            self.lin = nn.Linear(hidden, hidden)
            self.norm = {"layer": nn.LayerNorm(hidden), "batch": nn.BatchNorm1d(hidden)}.get(spec.norm, nn.Identity())
            self.act = nn.GELU()
            self.drop = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
            self.counter = spec.counter
            if spec.counter:  # a buffer the forward updates (no gradient, not sharded)
                self.register_buffer("seen", torch.zeros(hidden))
            self.inner = FuzzBlock(spec.inner, hidden) if spec.inner is not None else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.drop(self.act(self.norm(self.lin(x))))
            if self.counter:
                self.seen.mul_(0.9).add_(y.detach().mean(0), alpha=0.1)
            if self.inner is not None:
                y = self.inner(y)
            return x + y

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(shape.features, shape.hidden)
            if shape.tied:
                self.embed = nn.Embedding(shape.classes, shape.hidden)
            self.blocks = nn.ModuleList(FuzzBlock(b, shape.hidden) for b in shape.blocks)
            self.head = nn.Linear(shape.hidden, shape.classes)
            if shape.tied:
                self.head.weight = self.embed.weight

        def forward(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            h = self.inp(feats)
            if shape.tied:
                h = h + self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    torch.manual_seed(shape.model_seed)  # the same initial weights on every rank
    return Net()


def shard(model: Any, shape: Shape) -> None:
    """FSDP2 units as drawn, the innermost first; the root always."""
    from torch.distributed.fsdp import fully_shard

    def units(block: Any, spec: Block) -> None:
        if spec.inner is not None:
            units(block.inner, spec.inner)
        if spec.unit:
            fully_shard(block)

    for block, spec in zip(model.blocks, shape.blocks):
        units(block, spec)
    if shape.input_unit:
        fully_shard(model.inp)
    if shape.head_unit:
        fully_shard(model.head)
    fully_shard(model)


def local(tree: Any) -> Any:
    """Each DTensor as this rank's local shard."""
    if hasattr(tree, "to_local"):
        return tree.to_local().detach().clone()
    if isinstance(tree, dict):
        return {k: local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local(v) for v in tree)
    return tree


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    case = Case.from_json(Path(args[0]).read_text())
    shape = case.shape
    run_dir = Path(os.environ["RUN_DIR"])
    slot = int(os.environ.get("RANK", "0"))
    from ddp_hpc.contract import RECOVERY_GENERATION_VAR, RESTART_COUNT_VAR

    generation = int(os.environ.get(RECOVERY_GENERATION_VAR, "0") or 0)
    faults = Faults(case, slot, generation, run_dir)
    faults.at("appear")  # a replacement that dies as it starts

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_hpc.contract import atomic_write
    from ddp_hpc.engine.checkpoint import files as checkpoint_files
    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.recovery import rank as recovery_rank
    from ddp_hpc.engine.recovery import shards
    from ddp_hpc.engine.rng import capture_rng, seed_everything
    from ddp_hpc.engine.sampler import ResumableSampler

    fsdp2 = shape.strategy == "fsdp2"
    if fsdp2 or shape.checkpoint_format == "dcp":
        import torch.distributed.checkpoint as dcp
    samples = shape.steps_per_epoch * shape.accumulation * shape.batch * shape.world_size
    data = torch.Generator().manual_seed(shape.model_seed + 1)
    train_set = TensorDataset(torch.randn(samples, shape.features, generator=data),
                              torch.randint(0, shape.classes, (samples,), generator=data),
                              torch.randint(0, shape.classes, (samples,), generator=data))
    device = torch.device(os.environ.get(FUZZ_DEVICE_VAR) or "cpu")
    if device.type == "cuda":  # every rank on the one GPU; tied embeddings' backward sums with atomics otherwise
        torch.use_deterministic_algorithms(True)
    model = build_model(shape).to(device)

    recovery = InJobRecovery("gloo", run_dir=run_dir, snapshot_every=shape.snapshot_every if fsdp2 else None)
    faults.completed = lambda: recovery.step
    seed_everything(1000 + recovery.slot)  # each rank's own dropout
    if fsdp2:
        shard(model, shape)
    if shape.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = None
    if shape.scheduler == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    elif shape.scheduler == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    sampler = ResumableSampler(train_set, shuffle=True, seed=0, batch_size=shape.batch)
    loader = DataLoader(train_set, batch_size=shape.batch, sampler=sampler, generator=torch.Generator())
    objects = {"model": model, "optimizer": optimizer, "sampler": sampler}
    if scheduler is not None:
        objects["scheduler"] = scheduler
    checkpointer = Checkpointer(run_dir, objects, every_n_steps=shape.checkpoint_every,
                                format=shape.checkpoint_format)

    _install_faults(faults, shape, model, optimizer, recovery, generation, checkpoint_files, shards,
                    recovery_rank, dcp if fsdp2 or shape.checkpoint_format == "dcp" else None)
    if not recovery.joining:
        checkpointer.restore(quiet=True)

    def train(wrapped: nn.Module) -> None:
        for epoch in range(sampler.epoch, shape.epochs):
            sampler.set_epoch(epoch)
            micro: list[Any] = []
            for batch in loader:
                micro.append(batch)
                if len(micro) == shape.accumulation:
                    one_step(wrapped, micro)
                    micro = []

    def one_step(wrapped: nn.Module, micro: list[Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for index, batch in enumerate(micro):
            feats, tokens, targets = (tensor.to(device) for tensor in batch)
            faults.micro = index
            last = index == len(micro) - 1
            context = wrapped.no_sync() if not fsdp2 and not last else contextlib.nullcontext()
            if fsdp2 and shape.sync == "flag":
                model.set_requires_gradient_sync(last)
            with context:
                loss = nn.functional.cross_entropy(wrapped(feats, tokens), targets) / len(micro)
                loss.backward()
            total += loss.detach()
        if shape.step_work == "allreduce":  # a loss averaged over the ranks for a log line
            dist.all_reduce(total)
        optimizer.step()  # the optimizer fault fires in its pre-hook
        if scheduler is not None:
            scheduler.step()
        faults.at("window")
        if shape.step_work == "host":
            sum(i * i for i in range(20000))
        recovery.step_done(batches=len(micro))

    recovery.run(train, model=model, optimizer=optimizer, sampler=sampler, checkpointer=checkpointer)
    checkpointer.save(wait=True)
    state = {"model": local(model.state_dict()), "optimizer": local(optimizer.state_dict()),
             "scheduler": scheduler.state_dict() if scheduler is not None else None, "step": recovery.step,
             "sampler": sampler.state_dict(), "rng": capture_rng()}
    meta = {"pid": os.getpid(), "generation": generation, "restarts": int(os.environ.get(RESTART_COUNT_VAR, "0") or 0),
            "recoveries": len(recovery.recoveries), "world_size": dist.get_world_size(),
            "resumed": str(checkpointer.resumed.path) if checkpointer.resumed else None}
    (run_dir / "final").mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "final" / f"rank-{slot}.pt", lambda f: torch.save({"state": state, "meta": meta}, f),
                 durable=False)
    recovery.close()


def _install_faults(faults: Faults, shape: Shape, model: Any, optimizer: Any, recovery: Any, generation: int,
                    checkpoint_files: Any, shards: Any, recovery_rank: Any, dcp: Any) -> None:
    """The hooks and wrappers that fire this slot's faults (in this process only)."""
    if not faults.mine:
        return
    moments = {fault.moment for _, fault in faults.mine}
    modules = dict(model.named_modules())
    for name in {fault.module for _, fault in faults.mine if fault.moment in ("forward", "backward")}:
        module = modules[name]

        def forward_hook(module: Any, inputs: Any, output: Any, name: str = name) -> None:
            faults.at("forward", module=name)
            if "backward" in moments and getattr(output, "requires_grad", False):
                # Fires as the backward reaches this module's output: mid-backward.
                micro = faults.micro
                output.register_hook(lambda grad, name=name, micro=micro: _backward(faults, name, micro))

        module.register_forward_hook(forward_hook)
    if "optimizer" in moments:
        optimizer.register_step_pre_hook(lambda *_: faults.at("optimizer"))
    if "save" in moments:
        save_rank_part = checkpoint_files.save_rank_part

        def faulty_save_rank_part(directory: Any, global_step: int, rank: int, part: Any) -> Any:
            path = save_rank_part(directory, global_step, rank, part)  # its own part written, before the commit
            faults.at("save", step=global_step)
            return path

        checkpoint_files.save_rank_part = faulty_save_rank_part
        if dcp is not None:
            dcp_save = dcp.save

            def faulty_dcp_save(*args: Any, **kwargs: Any) -> Any:
                result = dcp_save(*args, **kwargs)
                faults.at("save", step=recovery.step)
                return result

            dcp.save = faulty_dcp_save
    if "snapshot" in moments:
        take, swap = shards.Snapshots.take, shards.Snapshots._swap

        def faulty_take(self: Any, step: int) -> None:
            faults.at("snapshot", step=step, sub="take")
            take(self, step)

        def faulty_swap(self: Any, step: int, payload: Any, link: Any) -> None:
            faults.at("snapshot", step=step, sub="keep")  # its own copy written, before the buddy has it
            swap(self, step, payload, link)

        shards.Snapshots.take, shards.Snapshots._swap = faulty_take, faulty_swap
    if "transfer" in moments and generation > 0:
        transfer = recovery_rank.InJobRecovery._transfer

        def faulty_transfer(self: Any, plan: Any, joining: bool) -> None:
            if joining:
                faults.at("transfer")
            transfer(self, plan, joining)

        recovery_rank.InJobRecovery._transfer = faulty_transfer


def _backward(faults: Faults, name: str, micro: int) -> None:
    saved, faults.micro = faults.micro, micro
    try:
        faults.at("backward", module=name)
    finally:
        faults.micro = saved


if __name__ == "__main__":
    main()

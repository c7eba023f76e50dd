"""The one reset of a step a lost peer broke (engine/recovery/broken_step.py), in one process:
a step is broken where a failed collective would break it, cleared, done again, and must give
what the same step gives unbroken."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return nn.functional.gelu(self.norm(self.linear(x)))


class RootOwns(nn.Module):
    """Blocks each under fully_shard, a head owned by the root (the shape issue 44 found)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Broken(RuntimeError):
    """What gloo raises when a peer's connection closes, as far as the loop can tell."""


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = RootOwns()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.to_local().clone() for name, p in model.named_parameters() if p.grad is not None}


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def _loss(model, seed: int):
    x, y = _batch(seed)
    return nn.functional.cross_entropy(model(x), y)


def _break_backward_in(module: nn.Module):
    """The backward fails in ``module`` (its first block, the last to run backward): the
    root's head has computed its gradient, its reduce-scatter not yet run."""
    def fail(*_):
        raise Broken("Connection closed by peer")

    return module.register_full_backward_pre_hook(fail)


@pytest.mark.parametrize("broken", ["backward", "accumulation"])
def test_a_backward_broken_with_root_owned_parameters_leaves_no_gradient_for_the_redone_step(one_rank, broken):
    """``backward``: the step's backward breaks after the root's head computed its gradient
    (left on FSDP2's unsharded parameter: it came out 2x a clean step's when redone).
    ``accumulation``: the first micro-batch of two ran without gradient sync (its unsharded
    gradients are kept for the next) and the second breaks. Either way, after
    ``clear_broken_step`` the redone step's gradients equal a clean step's bit for bit."""
    from ddp_hpc.engine.recovery.broken_step import clear_broken_step

    clean = _sharded()
    _loss(clean, 1).backward()
    expected = _grads(clean)

    model = _sharded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    if broken == "accumulation":
        model.set_requires_gradient_sync(False)
        _loss(model, 7).backward()
        model.set_requires_gradient_sync(True)
    handle = _break_backward_in(model.blocks[0])
    with pytest.raises(Broken):
        _loss(model, 1).backward()
    handle.remove()
    clear_broken_step(model, optimizer, [], sharded=True)
    _loss(model, 1).backward()
    redone = _grads(model)
    assert redone.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(redone[name], grad), (name, (redone[name] / grad).flatten()[:3])


def test_a_forward_broken_after_batch_norm_ran_puts_its_running_statistics_back():
    """DDP's state travels from a survivor's live model: the running statistics a broken
    forward updated would travel with it (and be updated again by the redone forward). They
    are put back as they were at the last step's end; an applied optimizer step is marked."""
    from ddp_hpc.engine.recovery.broken_step import StepStart, clear_broken_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = StepStart()
    handle = start.attach(optimizer)
    start.keep(model)
    before = {name: b.clone() for name, b in model.named_buffers()}
    model(torch.randn(5, 4)).sum().backward()  # the forward ran; a collective of the backward fails
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    clear_broken_step(model, optimizer, [], sharded=False, step_start=start)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert not start.applied
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    assert start.applied
    handle.remove()


def test_the_state_travels_from_the_lowest_step_among_members_whose_optimizer_step_was_not_applied():
    from ddp_hpc.engine.recovery.errors import RecoveryError
    from ddp_hpc.engine.recovery.transfer import transfer_source

    assert transfer_source([(5, False), (-1, False), (5, False)], 0) == (5, 0)
    assert transfer_source([(6, False), (5, False), (-1, False)], 0) == (5, 1)  # one a step ahead goes back
    # rank 0 applied step 6's optimizer step and then failed before counting it: not a source
    assert transfer_source([(5, True), (5, False), (-1, False)], 0) == (5, 1)
    assert transfer_source([(5, True), (6, False), (-1, False)], 0) == (6, 1)
    with pytest.raises(RecoveryError, match="between optimizer.step\\(\\) and step_done"):
        transfer_source([(5, True), (-1, False), (5, True)], 2)


def test_the_buffers_each_step_starts_from_are_kept_from_its_first_training_forward():
    """Under DDP's broadcast_buffers the first forward of a step starts from rank 0's
    buffers of the step before: what a replacement of rank 0 needs. An evaluation forward
    (not training) takes nothing."""
    from ddp_hpc.engine.recovery.broken_step import StepStart

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    start, done = StepStart(), [0]
    handle = start.watch(model, lambda: done[0])
    at_start = model[1].running_mean.clone()
    model(torch.randn(5, 4))
    model(torch.randn(5, 4))  # the second micro-batch of the step: not its start
    assert torch.equal(start.received(1)["1.running_mean"], at_start)
    assert start.received(2) is None
    done[0] = 1
    model.eval()
    model(torch.randn(5, 4))
    assert start.received(2) is None
    handle.remove()


def test_rank_0s_buffers_of_a_step_s_end_arrive_in_its_optimizer_step_and_start_the_next_once_counted():
    """``share``: the optimizer's pre-hook broadcasts rank 0's buffers (here a stand-in that
    writes rank 0's values); they become ``received`` for the next step only once the step is
    counted, and the next step's first forward (DDP's own broadcast, over gloo) replaces them.
    A broken step's broadcast is dropped; a transfer sets them on every rank."""
    from ddp_hpc.engine.recovery.broken_step import StepStart

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank0s = {"1.running_mean": torch.full((6,), 7.0)}
    sent = []

    def broadcast(tensors):  # this rank is not rank 0: rank 0's values arrive
        sent.append(len(tensors))
        for name, tensor in zip([n for n, _ in model.named_buffers()], tensors):
            if name in rank0s:
                tensor.copy_(rank0s[name])

    def a_step():
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()

    start, done = StepStart(), [0]
    start.forward_receives = False  # over NCCL: only share's broadcast counts
    handles = [start.watch(model, lambda: done[0]), start.share(optimizer, model, lambda: done[0], broadcast)]
    a_step()
    assert sent == [3] and start.received(1) is None and start.received(2) is None  # not counted yet
    done[0] = 1
    start.counted(1)
    assert torch.equal(start.received(2)["1.running_mean"], rank0s["1.running_mean"])
    assert not torch.equal(model[1].running_mean, rank0s["1.running_mean"])  # the model keeps its own
    start.counted(2)  # step 2 without an optimizer step (a scaler's skip): nothing to go on from
    assert start.received(3) is None and start.received(2) is not None

    a_step()  # step 3, broken after its broadcast: dropped, the step is not counted
    start.put_back(model)
    start.counted(3)
    assert start.received(4) is None

    start.forward_receives, done[0] = True, 3  # over gloo: the next forward's broadcast replaces share's
    rank0s["1.running_mean"] = torch.full((6,), 9.0)
    a_step()
    start.counted(4)
    assert torch.equal(start.received(5)["1.running_mean"], rank0s["1.running_mean"])
    done[0] = 4
    at_forward = model[1].running_mean.clone()  # what DDP's broadcast left, say: a change after the step
    model(torch.randn(5, 4))
    assert torch.equal(start.received(5)["1.running_mean"], at_forward)

    start.transferred({"1.running_mean": torch.full((6,), 3.0)}, 8)
    assert start.received(9)["1.running_mean"][0] == 3.0 and start.received(5) is None
    start.transferred(None, 8)
    assert start.received(9) is None
    for handle in handles:
        handle.remove()


def test_an_lr_scheduler_that_would_not_travel_to_a_replacement_is_refused():
    """Built on the optimizer before ``run`` and not among the Checkpointer's objects (or with
    no Checkpointer), a scheduler would restart on a replacement: refused. Among the objects,
    or not built yet (inside ``train``), or on another optimizer: let through."""
    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
    from ddp_hpc.engine.recovery.refusals import schedule_refusal

    model = nn.Linear(3, 2)

    def optimizer():
        return torch.optim.SGD(model.parameters(), lr=0.1)

    plain = optimizer()
    assert schedule_refusal(plain, None) is None
    outside = optimizer()
    torch.optim.lr_scheduler.OneCycleLR(outside, max_lr=0.1, total_steps=10)
    held = Checkpointer("unused", {"model": model, "optimizer": outside})
    assert "not among the Checkpointer's objects" in schedule_refusal(outside, held)
    assert "not among the Checkpointer's objects" in schedule_refusal(outside, None)
    other = optimizer()
    held_other = Checkpointer("unused", {"optimizer": outside,
                                         "scheduler": torch.optim.lr_scheduler.StepLR(other, step_size=2)})
    assert schedule_refusal(outside, held_other) is not None  # a scheduler of another optimizer
    inside = optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(inside, lambda step: 1.0)
    assert schedule_refusal(inside, Checkpointer("unused", {"optimizer": inside, "scheduler": scheduler})) is None


def test_a_step_the_checkpointer_makes_while_it_saves_is_not_the_loops(one_rank, tmp_path):
    """torch's state-dict API steps an optimizer without state at lr 0 to create it (a dcp
    save of a DDP model, a file save of an FSDP2 model): not an applied step of the loop,
    which would make every rank no source of the state after a loss. The Checkpointer says
    it is saving, and ``InJobRecovery.run`` ignores the steps made meanwhile."""
    import ddp_hpc
    from ddp_hpc.engine.recovery.broken_step import StepStart

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state, ever
    checkpointer = ddp_hpc.Checkpointer(tmp_path / "run", {"model": model, "optimizer": optimizer}, format="dcp")
    start = StepStart()
    handle = start.attach(optimizer, ignore=lambda: checkpointer.saving)
    checkpointer.save(wait=True)
    assert not start.applied and not checkpointer.saving
    handle.remove()
    watched = StepStart()
    handle = watched.attach(optimizer)  # without the ignore, the save's step counts: what it is for
    checkpointer.step_done()
    checkpointer.save(wait=True)
    assert watched.applied
    handle.remove()

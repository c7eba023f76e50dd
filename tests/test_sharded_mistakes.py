"""A sharded (FSDP2) model's mistakes refused in one line, and its single-file checkpoint
whole (issue 44): under ``ddp-hpc launch --recover`` each mistake ends every rank with one
line and status 2 before the first step, spending neither a recovery nor a restart; a
``Checkpointer(format="file")`` gathers the whole state and every rank restores its own
slice of it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, clean_env, ddp_hpc_command

MISTAKES = str(REPO / "tests" / "scripts" / "sharded_mistakes.py")
FILE_CHECKPOINT = str(REPO / "tests" / "scripts" / "fsdp2_file_checkpoint.py")
OWN_BUFFERS = str(REPO / "tests" / "scripts" / "fsdp2_own_buffers.py")


def launch(script: str, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ddp_hpc_command(), "launch", "--nproc", "2", *flags, "--", "python", script],
                          env=clean_env(env), cwd=REPO, capture_output=True, text=True, timeout=240)


@pytest.mark.multiproc
@pytest.mark.parametrize("mistake,checkpointer,line", [
    ("root_not_sharded", "", "belong to no fully_shard unit, so they are never reduced over the ranks"),
    ("root_not_sharded", "file", "Checkpointer: the model is sharded (fully_shard) but its parameter(s) 2.weight"),
    ("optimizer_before_shard", "", "the optimizer steps 6 of its 6 tensors that are not the sharded model's"),
    ("shard_before_recovery", "", "InJobRecovery started after a process group already existed"),
    ("ddp_around", "", "a sharded (FSDP2) model is its own wrapper"),
    ("scheduler_outside", "dcp", "an LR scheduler was built on the optimizer and is not among the Checkpointer's"),
])
def test_each_mistake_with_a_sharded_model_ends_every_rank_in_one_line_with_2_spending_no_recovery_or_restart(
        tmp_path, mistake, checkpointer, line):
    run_dir = tmp_path / "run"
    done = launch(MISTAKES, "--recover", "1", "--max-restarts", "2",
                  env={"MISTAKE": mistake, "CHECKPOINTER": checkpointer, "RUN_DIR": str(run_dir)})
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    for rank in (0, 1):
        assert len(re.findall(rf"^rank {rank}: .*{re.escape(line)}", output, re.MULTILINE)) == 1, output[-4000:]
    assert "Traceback" not in output and "step 1" not in output, output[-4000:]
    assert "restart 1 of 2" not in output and "replacement started" not in output, output[-4000:]
    assert "not restarted" in output, output[-4000:]
    assert not list(run_dir.glob("record/recovery-*.json"))


@pytest.mark.multiproc
def test_a_sharded_model_saved_in_one_file_on_two_ranks_holds_its_whole_state_and_each_rank_restores_its_own(
        tmp_path):
    """Trained two steps and saved with format="file", restored into a model and optimizer of
    other weights: every tensor of each rank's slices, parameters and AdamW's state, is what
    it saved; the file holds whole tensors that load into the plain model."""
    import torch
    from torch import nn

    from ddp_hpc.engine.checkpoint.files import load_checkpoint

    done = launch(FILE_CHECKPOINT, env={"OUT": str(tmp_path)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        same = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert len(same) == 6 + 6 * 3 and all(same.values()), (rank, same)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    plain = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Sequential(nn.Linear(16, 16), nn.GELU()),
                          nn.Linear(16, 3))
    plain.load_state_dict(state["model"])
    assert all(type(tensor) is torch.Tensor for tensor in state["model"].values())
    moments = [state["optimizer"]["state"][i]["exp_avg"] for i in range(6)]
    assert [m.shape for m in moments] == [p.shape for p in plain.parameters()]


@pytest.mark.multiproc
@pytest.mark.parametrize("form", ["file", "dcp"])
def test_each_rank_of_a_sharded_model_gets_its_own_buffers_back_from_a_checkpoint(tmp_path, form):
    """FSDP2 shards parameters, not buffers, and reduces no buffer: each rank's BatchNorm
    statistics (and a buffer its forward counts in) are its own. A checkpoint's model state holds
    rank 0's; each rank takes its own back from its part of the checkpoint (the fuzzer's
    FSDP2 cases that restarted in place from a checkpoint ended with rank 0's on rank 1)."""
    done = launch(OWN_BUFFERS, env={"OUT": str(tmp_path), "FORMAT": form})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert found["ranks_differ"], "the ranks' buffers were the same: the test shows nothing"
        assert sorted(found["same"]) == ["0.1.num_batches_tracked", "0.1.running_mean", "0.1.running_var", "seen"]
        assert all(found["same"].values()), (rank, found["same"])


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _model(root: bool = True):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    if root:
        fully_shard(model)
    return model


@pytest.mark.parametrize("mistake,fragment", [
    ("root_not_sharded", "its parameter(s) 1.weight, 1.bias belong to no fully_shard unit"),
    ("optimizer_before_shard", "optimizer 'optimizer' steps 4 of its 4 tensors that are not the sharded model's"),
    ("optimizer_alone", "optimizer 'optimizer' steps a sharded (FSDP2) model that is not among the objects"),
])
def test_without_recovery_the_checkpointer_refuses_a_sharded_model_that_would_train_wrongly(one_rank, tmp_path,
                                                                                             mistake, fragment):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
    from ddp_hpc.errors import RefusedOnRank

    if mistake == "optimizer_before_shard":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        optimizer = torch.optim.Adam(model.parameters())
        fully_shard(model[0])
        fully_shard(model)
    else:
        model = _model(root=mistake != "root_not_sharded")
        optimizer = torch.optim.Adam(model.parameters())
    objects = {"optimizer": optimizer} if mistake == "optimizer_alone" else {"model": model, "optimizer": optimizer}
    with pytest.raises(RefusedOnRank) as refused:
        Checkpointer(tmp_path, objects, format="file")
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
    assert refused.value.code == 2 and not dist.is_initialized()  # the group ended before the exit


def test_a_file_holding_one_ranks_shards_is_refused_not_loaded(one_rank, tmp_path):
    """A single file an older version wrote of a sharded model held rank 0's shards (DTensors):
    restoring it would load them into every rank; it is refused in one line."""
    import torch

    from ddp_hpc.engine.checkpoint.files import CheckpointError
    from ddp_hpc.engine.checkpoint.formats import _load_objects

    model = _model()
    before = {name: tensor.to_local().clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="holds one rank's shards of 'model', not its whole state"):
        _load_objects({"model": model}, {"model": model.state_dict()}, Path("step-00000001.pt"))
    assert all(torch.equal(before[name], tensor.to_local()) for name, tensor in model.state_dict().items())


def test_in_job_recovery_made_after_a_group_exists_is_refused_in_one_line_and_ends_that_group(one_rank):
    import torch.distributed as dist

    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.errors import RefusedOnRank

    with pytest.raises(RefusedOnRank, match="construct InJobRecovery first") as refused:
        InJobRecovery("gloo", environ={"RANK": "0", "WORLD_SIZE": "1"})
    assert refused.value.code == 2 and not dist.is_initialized()


@pytest.mark.parametrize("mistake,fragment", [
    ("wrap", "a sharded (FSDP2) model is its own wrapper: give run the model itself, with no DDP around it and no wrap"),
    ("root_not_sharded", "its parameter(s) 1.weight, 1.bias belong to no fully_shard unit"),
    ("optimizer_before_shard", "the optimizer steps 4 of its 4 tensors that are not the sharded model's parameters"),
])
def test_without_recovery_run_refuses_a_sharded_model_that_would_train_wrongly_before_wrapping_it(mistake, fragment):
    """``InJobRecovery`` outside a recovering launch (one rank, its own rendezvous): ``run``
    refuses in one line, before ``wrap`` is called or a step taken, and ends its group."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.environment.ports import free_port
    from ddp_hpc.errors import RefusedOnRank

    recovery = InJobRecovery("gloo", environ={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                              "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(free_port())})
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        optimizer = torch.optim.Adam(model.parameters()) if mistake == "optimizer_before_shard" else None
        fully_shard(model[0])
        if mistake != "root_not_sharded":
            fully_shard(model)
        optimizer = optimizer or torch.optim.Adam(model.parameters())
        called: list[str] = []
        with pytest.raises(RefusedOnRank) as refused:
            recovery.run(lambda m: called.append("train"), model=model, optimizer=optimizer,
                         wrap=(lambda m: called.append("wrap")) if mistake == "wrap" else None)
        assert fragment in str(refused.value) and "\n" not in str(refused.value) and refused.value.code == 2
        assert called == [] and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_legitimate_sharded_models_are_not_refused_and_a_wrapped_one_restores_from_one_file(one_rank, tmp_path):
    """Two shapes the refusals must let through: a frozen plain parameter on the root (a
    frozen backbone beside sharded trainable blocks: nothing of it is trained or reduced),
    and a block under activation checkpointing (``checkpoint_wrapper``), whose parameter
    names carry ``_checkpoint_wrapped_module.`` where torch's state-dict API leaves it out:
    its single-file checkpoint saves and restores (it failed with "Missing optimizer state
    for parameter '0.weight'")."""
    import torch
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(checkpoint_wrapper(nn.Linear(4, 4)), nn.Linear(4, 2))
    model.register_parameter("frozen", nn.Parameter(torch.ones(3), requires_grad=False))
    fully_shard(model[0])
    fully_shard(model[1])
    model.frozen = nn.Parameter(torch.ones(3), requires_grad=False)  # left plain: no fully_shard of the root
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(tmp_path, {"model": model, "optimizer": optimizer}, format="file")
    checkpointer.step_done()
    checkpointer.save(wait=True)
    moments = [optimizer.state[p]["exp_avg"].to_local().clone() for p in model.parameters() if p.requires_grad]
    for group in optimizer.state.values():
        group["exp_avg"].to_local().zero_()
    assert Checkpointer(tmp_path, {"model": model, "optimizer": optimizer}, format="file").restore() is not None
    again = [optimizer.state[p]["exp_avg"].to_local() for p in model.parameters() if p.requires_grad]
    assert all(torch.equal(one, other) for one, other in zip(moments, again))

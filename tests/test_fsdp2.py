"""``training.strategy: fsdp2``: what is refused, which modules become units, and real
ranks under torchrun: a 2-rank fsdp2 run trains like one rank of twice the batch while each
rank holds half the state, and a run resumed 2 -> 3 -> 1 ranks trains every sample once."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
from torch import nn

from conftest import FIGURES, REPO, load_last_checkpoint
from ddp_hpc.config import load_config
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.startup.distributed import process_group
from ddp_hpc.engine.checkpoint.files import load_checkpoint
from ddp_hpc.errors import UserError
from ddp_hpc.builtin_jobs.synthetic import make_mlp
from ddp_hpc.training.job import create_job
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.run_on_rank import train
from ddp_hpc.training.strategy import is_sharded, model_state, shard_units, wrap_model
from ddp_hpc.training.trainer import Trainer

sys.path.insert(0, str(REPO / "tests"))
from fsdp2_helpers import read_losses  # noqa: E402
from stop_helpers import count_ids  # noqa: E402
from test_stop_resume import _record, assert_stopped_with_75, torchrun  # noqa: E402
from test_training import SMALL_SYNTHETIC, read_run, torchrun_train  # noqa: E402

FSDP2 = ["training.strategy=fsdp2"]


@pytest.mark.parametrize("override,fragment", [
    ("training.zero_optimizer=true", "training.zero_optimizer cannot be used with training.strategy=fsdp2"),
    ("training.ema_decay=0.9", "training.ema_decay cannot be used with training.strategy=fsdp2"),
    ("training.precision=fp16", "training.precision=fp16 cannot be used with training.strategy=fsdp2"),
    ("distributed.comm_hook=fp16", "distributed.comm_hook cannot be used"),
    ("distributed.find_unused_parameters=true", "distributed.find_unused_parameters cannot be used"),
    ("distributed.static_graph=true", "distributed.static_graph cannot be used"),
    ("distributed.weights_check_every=5", "distributed.weights_check_every cannot be used"),
    ("checkpoint.async=true checkpoint.format=file", "checkpoint.async with checkpoint.format=file cannot be used"),
])
def test_options_that_cannot_work_on_shards_are_refused_in_one_line(override, fragment):
    load_config(None, override.split())  # fine under ddp
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(None, [*FSDP2, *override.split()])


def test_the_fsdp_section_under_ddp_is_refused():
    load_config(None, [*FSDP2, "fsdp.mixed_precision=bf16"])
    with pytest.raises(ConfigError, match="the fsdp section is set but training.strategy is ddp"):
        load_config(None, ["fsdp.mixed_precision=bf16"])
    with pytest.raises(ConfigError, match="fsdp.activation_checkpointing recomputes the units"):
        load_config(None, [*FSDP2, "fsdp.activation_checkpointing=true"])


@pytest.mark.parametrize("version", ["2.5.1+cu124", "2.6.0", "2.7.1"])
def test_fsdp2_on_a_torch_that_cannot_run_it_is_refused_before_any_group_or_file(tmp_path, monkeypatch, version):
    monkeypatch.setattr("ddp_hpc.training.strategy.installed", lambda: version)
    monkeypatch.setattr("ddp_hpc.training.run_on_rank.process_group",
                        lambda *args, **kwargs: pytest.fail("a process group was started"))
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError) as refused:
        train(None, [*FSDP2, f"logging.run_dir={runs}"])
    assert str(refused.value) == (f"training.strategy=fsdp2 needs torch 2.8 or newer, and this is torch {version}: "
                                  "use training.strategy=ddp, or install torch>=2.8")
    assert not runs.exists()
    with process_group() as ctx, pytest.raises(ConfigError, match="needs torch 2.8"):
        wrap_model(nn.Linear(2, 2), load_config(None, FSDP2), ctx)  # a Trainer built without train()
    wrap_model(nn.Linear(2, 2), load_config(None, []), ctx)  # ddp runs there


def test_under_ddp_a_torch_without_fsdp2_never_imports_it(monkeypatch):
    """torch 2.5 has no torch.distributed.fsdp.FSDPModule: a ddp run must not ask for it."""
    monkeypatch.setattr("ddp_hpc.training.strategy.installed", lambda: "2.5.1")
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)  # importing it raises ImportError
    model = nn.Linear(2, 2)
    assert not is_sharded(model)
    assert model_state(model).keys() == {"weight", "bias"}


def test_units_are_the_named_classes_and_the_modules_over_the_threshold_innermost_first():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 2))
    by_class = shard_units(model, load_config(None, [*FSDP2, "fsdp.wrap=[Linear]"]).fsdp)
    assert by_class == [model[0][0], model[0][2], model[1]]
    # Linear(4, 8): 40 parameters, Linear(8, 8): 72, so the inner block 112, Linear(8, 2): 18.
    by_size = shard_units(model, load_config(None, [*FSDP2, "fsdp.min_params=60"]).fsdp)
    assert by_size == [model[0][2]]  # the block keeps only 40 outside it
    assert shard_units(model, load_config(None, [*FSDP2, "fsdp.min_params=100"]).fsdp) == [model[0]]
    with pytest.raises(UserError, match=r"fsdp.wrap names Block, which the model does not contain "
                                        r"\(its module classes: Linear, ReLU, Sequential\)"):
        shard_units(model, load_config(None, [*FSDP2, "fsdp.wrap=[Linear, Block]"]).fsdp)


# Every option that works under fsdp2, at once: units, recomputed activations, accumulation
# over two micro-batches, clipping, a schedule.
TWO_RANK_FSDP2 = [*SMALL_SYNTHETIC, "training.epochs=2", "training.optimizer=adam", "training.lr=0.01",
                  "training.grad_accum_steps=2", "training.grad_clip_norm=0.5", "training.scheduler.name=cosine"]


def _fit_one_process(tmp_path: Path, overrides: list[str]):
    config = load_config(REPO / "configs" / "synthetic.yaml",
                         [f"logging.run_dir={tmp_path / 'runs'}", "logging.name=one", "logging.plot=false",
                          *overrides])
    with process_group(environ={}) as ctx:
        trainer = Trainer(create_job(config.job.name, config.job.params), config, ctx, RunFolder(tmp_path / "runs" / "one"))
        return trainer.fit()


@pytest.mark.multiproc
def test_fsdp2_on_two_ranks_trains_like_one_rank_of_twice_the_batch_holding_half_the_state(tmp_path):
    result = torchrun_train(tmp_path, 2, [*TWO_RANK_FSDP2, *FSDP2, "training.batch_size=16", "fsdp.wrap=[Linear]",
                                          "fsdp.activation_checkpointing=true", "checkpoint.format=file"], name="fsdp2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fsdp2: 4 units sharded over 2 ranks (Linear), activations recomputed" in result.stderr
    summary, rows = read_run(tmp_path, "fsdp2")
    one = _fit_one_process(tmp_path, [*TWO_RANK_FSDP2, "training.batch_size=32"])

    for row, expected in zip(rows, read_run(tmp_path, "one")[1], strict=True):
        assert row["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5)
        assert row["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    # Each rank's checksum is of the whole (gathered) model.
    checksums = summary["parameter_checksums_per_rank"]
    assert checksums[0] == checksums[1] == pytest.approx(one.parameter_checksums_per_rank[0], rel=1e-5)

    # Parameters plus Adam's two moments: one process holds them all, each fsdp2 rank half.
    whole = one.state_bytes_per_rank[0]
    assert whole >= 3 * 4 * sum(p.numel() for p in make_mlp(16, 32, 2, 10).parameters())
    for held in summary["state_bytes_per_rank"]:
        assert 0.45 * whole <= held <= 1.1 * whole / 2, (held, whole)
    FIGURES.append(f"fsdp2, 2 ranks: parameter + optimizer-state bytes per rank {summary['state_bytes_per_rank']} "
                   f"against {whole} in one process (ratio {max(summary['state_bytes_per_rank']) / whole:.3f})")

    # checkpoint.format file: the checkpoint holds the whole model and optimizer state,
    # numbered as DDP's are; it loads into the plain model.
    state = load_checkpoint(tmp_path / "runs" / "fsdp2" / "checkpoints" / "last.pt")
    plain = make_mlp(16, 32, 2, 10)
    plain.load_state_dict(state["model"])
    exp_avg = [state["optimizer"]["state"][i]["exp_avg"] for i in range(len(list(plain.parameters())))]
    assert [m.shape for m in exp_avg] == [p.shape for p in plain.parameters()]
    checksum = float(sum(p.detach().double().sum() for p in plain.parameters()))
    assert checksum == pytest.approx(checksums[0], rel=1e-9)


# The default checkpoint format under fsdp2, dcp: every rank writes its shards. A hidden
# layer of 12: its weight and bias split 6 + 6 over 2 ranks and 4 + 4 + 4 over 3; a learning
# rate small enough that the loss falls at every step (Adam at 0.01 overshoots and climbs back).
# 60 samples. On 2 ranks of batch 4: 8 steps per epoch, stopped at step 11 = epoch 1 after 24
# samples; on 3 ranks the other 36 take 3 steps, stopped after 2 (step 13, 48 samples); on
# one rank the last 12 take 3 steps, then 15 steps of epoch 2.
RESHARD_CONFIG = ["job.params.size=60", "job.params.hidden=12", "training.epochs=3", "training.batch_size=4",
                  "training.optimizer=adam",
                  "training.lr=0.002", "checkpoint.preemption_check_every_n_steps=1", *FSDP2]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.reliability
def test_fsdp2_resumed_on_three_then_one_rank_trains_every_sample_once_and_the_loss_goes_on(tmp_path):
    """Stopped on 2 ranks, resumed on 3, stopped, resumed on 1: each resumed run starts with
    exactly the parameters and Adam moments the checkpoint holds, resharded (a tensor split
    6 + 6 is read back as 4 + 4 + 4, then whole)."""
    import torch

    config, runs, losses = tmp_path / "recording.yaml", tmp_path / "runs", tmp_path / "losses"
    config.write_text("job:\n  name: 'stop_helpers:RecordingJob'\n")
    record_losses = f"{{target: 'fsdp2_helpers:RecordLosses', params: {{folder: '{losses}'}}}}"
    record_restored = f"{{target: 'fsdp2_helpers:RecordRestored', params: {{folder: '{tmp_path / 'restored'}'}}}}"
    stops = {2: 11, 3: 13}
    saved: dict[int, dict] = {}
    for nproc in (2, 3, 1):
        extra = [record_losses, record_restored] + ([f"{{target: 'stop_helpers:StopAtStep', params: {{step: {stops[nproc]}}}}}"]
                                   if nproc in stops else [])
        result = torchrun(tmp_path, nproc, config, [*RESHARD_CONFIG, _record(tmp_path / f"ids-{nproc}", *extra)],
                          name="r")
        if nproc in stops:
            assert_stopped_with_75(result, nproc)
            state = load_last_checkpoint(runs / "r" / "checkpoints")
            assert (state["world_size"], state["progress"]["global_step"]) == (nproc, stops[nproc])
            saved[nproc] = state
        else:
            assert result.returncode == 0, result.stderr[-3000:]
        if nproc != 2:
            assert re.search(rf"written by \d ranks, on {nproc}: .* epoch 2 continues after "
                             rf"{24 if nproc == 3 else 48} of its samples", result.stderr), result.stderr[-3000:]

    counts = count_ids(*(tmp_path / f"ids-{n}" for n in (2, 3, 1)))
    assert [counts[epoch] for epoch in range(3)] == [Counter(range(60))] * 3
    assert (runs / "r" / "checkpoints" / "last.dcp").exists() and not (runs / "r" / "checkpoints" / "last.pt").exists()
    final = load_last_checkpoint(runs / "r" / "checkpoints")
    assert final["progress"]["global_step"] == 13 + 3 + 15 and final["world_size"] == 1
    assert int(final["optimizer"]["state"]["0.weight"]["step"]) == 31  # Adam's state went on through both resumes

    for nproc, splits in ((2, [6, 6]), (3, [4, 4, 4]), (1, [12])):  # each rank's rows of the hidden layer
        shapes = [json.loads((tmp_path / "restored" / f"shapes-{nproc}-{rank}.json").read_text())
                  for rank in range(nproc)]
        assert [shape["0.weight"] for shape in shapes] == [[rows, 1] for rows in splits]
        assert [shape["0.bias"] for shape in shapes] == [[rows] for rows in splits]
    for nproc, written_by in ((3, 2), (1, 3)):  # what each resumed run started from: the checkpoint, exactly
        restored = torch.load(tmp_path / "restored" / f"restored-{nproc}.pt", weights_only=True)
        checkpoint = saved[written_by]
        assert sorted(restored["model"]) == sorted(checkpoint["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        for name, value in checkpoint["model"].items():
            assert torch.equal(restored["model"][name], value), (nproc, name)
        assert sorted(restored["optimizer"]["state"]) == sorted(checkpoint["optimizer"]["state"])
        for name, moments in checkpoint["optimizer"]["state"].items():
            assert sorted(moments) == ["exp_avg", "exp_avg_sq", "step"]
            for moment, value in moments.items():
                assert torch.equal(restored["optimizer"]["state"][name][moment], value), (nproc, name, moment)
        assert int(checkpoint["optimizer"]["state"]["0.weight"]["step"]) == stops[written_by]

    # The whole training set's loss after the first step of each resumed run stays within
    # 10% of its loss at the checkpoint.
    loss = read_losses(losses)
    assert sorted(loss) == list(range(1, 32))
    for stop in stops.values():
        assert loss[stop + 1] <= 1.1 * loss[stop], (stop, loss[stop], loss[stop + 1])
    FIGURES.append(f"fsdp2 resumed 2 -> 3 -> 1 ranks: every sample of each epoch once; training-set loss "
                   f"{loss[11]:.4g} -> {loss[12]:.4g} and {loss[13]:.4g} -> {loss[14]:.4g} across the resumes")

"""The Trainer: in-process checks of the loop, and real 2-rank runs for what only
distributed runs can show (equivalence across world sizes, shared early stopping,
exact resume after SIGKILL)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import REPO, assert_same_training_state, clean_env, load_last_checkpoint
from ddp_hpc.config import load_config
from ddp_hpc.summary import RunSummary
from ddp_hpc.startup.distributed import process_group
from ddp_hpc.training import Datasets, Job, StepOutput
from ddp_hpc.engine.checkpoint.files import load_checkpoint
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.training.data import shard_padding_mask
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.trainer import Trainer

SMALL_SYNTHETIC = ["job.name=synthetic", "job.params.samples=512", "job.params.val_samples=101",
                   "job.params.input_dim=16", "job.params.hidden=32", "job.params.depth=2",
                   "training.optimizer=sgd", "training.lr=0.05", "logging.progress=never"]


class IndexJob(Job):
    """Records which samples each epoch's first batch holds."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.first_batches: list[list[int]] = []
        self._seen_epoch_start = False

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def build_datasets(self) -> Datasets:
        ids = torch.arange(self.size, dtype=torch.float32).unsqueeze(1)
        return Datasets(train=TensorDataset(ids, ids))

    def training_step(self, model, batch) -> StepOutput:
        ids, target = batch
        if self.trainer_batch == 0:
            self.first_batches.append(ids.squeeze(1).long().tolist())
        self.trainer_batch = (self.trainer_batch + 1) % self.batches_per_epoch
        loss = nn.functional.mse_loss(model(ids / self.size), target / self.size, reduction="none").squeeze(1)
        return StepOutput(loss.mean(), {"loss": loss.detach()})


def _fit_in_process(job: Job, tmp_path: Path, overrides: list[str]) -> RunSummary:
    config = load_config(None, [f"logging.run_dir={tmp_path}", "logging.name=r", "logging.progress=never",
                                "logging.plot=false", *overrides])
    with process_group(environ={}) as ctx:
        return Trainer(job, config, ctx, RunFolder(tmp_path / "r")).fit()


def test_every_epoch_has_a_new_order(tmp_path):
    job = IndexJob(64)
    job.trainer_batch, job.batches_per_epoch = 0, 8
    _fit_in_process(job, tmp_path, ["training.epochs=3", "training.batch_size=8", "checkpoint.resume=never"])
    assert len(job.first_batches) == 3
    assert len({tuple(b) for b in job.first_batches}) == 3, job.first_batches


def test_sampler_order_does_not_depend_on_world_size():
    data = TensorDataset(torch.arange(40))
    single = list(ResumableSampler(data, 1, 0, shuffle=True, seed=3))
    ranks = [list(ResumableSampler(data, 4, r, shuffle=True, seed=3)) for r in range(4)]
    # The k-th group of 4 consecutive samples of one rank's order is spread over the 4 ranks.
    assert [sorted(r[k] for r in ranks) for k in range(10)] == [sorted(single[4 * k:4 * k + 4]) for k in range(10)]


def test_resumable_sampler_skips_exactly():
    sampler = ResumableSampler(TensorDataset(torch.arange(50)), 2, 1, shuffle=True, seed=0)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.skip_next(7)
    assert len(sampler) == len(full) - 7 and list(sampler) == full[7:]
    assert list(sampler) == full  # the skip applies to one pass only


@pytest.mark.parametrize("size,world", [(101, 2), (101, 4), (7, 3), (1, 2), (64, 4)])
def test_padding_mask_counts_each_sample_once(size, world):
    data = TensorDataset(torch.arange(size))
    from torch.utils.data import DistributedSampler

    seen = []
    for rank in range(world):
        indices = list(DistributedSampler(data, world, rank, shuffle=False))
        mask = shard_padding_mask(0, len(indices), rank, world, size, torch.device("cpu"))
        seen += [i for i, keep in zip(indices, mask.tolist()) if keep]
    assert sorted(seen) == list(range(size))


def test_gradient_accumulation_matches_a_larger_batch(tmp_path):
    def final_weights(overrides):
        config_overrides = [*SMALL_SYNTHETIC, "training.epochs=2", "checkpoint.resume=never", *overrides]
        job = load_config(None, config_overrides)
        from ddp_hpc.training.job import create_job
        summary = _fit_in_process(create_job(job.job.name, job.job.params), tmp_path / overrides[0], config_overrides)
        return summary.parameter_checksums_per_rank[0], summary.final["train_loss"]

    big = final_weights(["training.batch_size=32", "training.grad_accum_steps=1"])
    accumulated = final_weights(["training.batch_size=16", "training.grad_accum_steps=2"])
    assert accumulated[0] == pytest.approx(big[0], rel=1e-5)
    assert accumulated[1] == pytest.approx(big[1], rel=1e-5)


def test_preference_job_learns(tmp_path):
    from ddp_hpc.training.job import create_job
    config = load_config(REPO / "configs" / "preference.yaml")
    summary = _fit_in_process(create_job("preference", {}), tmp_path,
                              ["job.name=preference", "training.epochs=4", "training.ema_decay=0.9",
                               "validation.early_stopping.metric=pair_accuracy",
                               "validation.early_stopping.mode=max"])
    assert config.job.name == "preference"
    assert summary.final["val_pair_accuracy"] > 0.85


def test_every_hook_receives_the_trainer_with_all_that_a_callback_may_read_as_documented(tmp_path):
    """callbacks.TrainerView (what a callback may read) is what the hooks' trainer answers,
    and docs/training.md names exactly that."""
    from ddp_hpc.training.callbacks import Callback, TrainerView
    from ddp_hpc.training.job import create_job

    readable = sorted(name for name in vars(TrainerView) if not name.startswith("_"))
    seen: dict[str, list[str]] = {}

    class ReadsEverything(Callback):
        def _read(self, hook: str, trainer) -> None:
            seen[hook] = sorted(name for name in readable
                                if getattr(trainer, name, AttributeError) is not AttributeError)
            assert type(trainer).__name__ == "Trainer"

        def on_fit_start(self, trainer) -> None:
            self._read("fit start", trainer)

        def on_step_end(self, trainer) -> None:
            self._read("step end", trainer)

        def on_fit_end(self, trainer, summary) -> None:
            self._read("fit end", trainer)

    config = load_config(None, [*SMALL_SYNTHETIC, "job.params.samples=64", "training.epochs=1",
                                f"logging.run_dir={tmp_path}", "logging.name=r", "logging.plot=false"])
    with process_group(environ={}) as ctx:
        Trainer(create_job(config.job.name, config.job.params), config, ctx, RunFolder(tmp_path / "r"),
                [ReadsEverything()]).fit()
    assert seen == {hook: readable for hook in ("fit start", "step end", "fit end")}, \
        {hook: sorted(set(readable) - set(names)) for hook, names in seen.items()}
    documented = (REPO / "docs" / "training.md").read_text().split("what a callback may read of it is", 1)[1]
    documented = documented.split(". A callback with", 1)[0]
    assert sorted(re.findall(r"`(\w+)(?:\(\w*\))?`", documented)) == readable, documented


# ----- real ranks -------------------------------------------------------------------------

def torchrun_train(tmp_path: Path, nproc: int, overrides: list[str], *, name: str,
                   timeout: float = 240) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "ddp_hpc", "train", str(REPO / "configs" / "synthetic.yaml"),
            f"logging.run_dir={tmp_path / 'runs'}", f"logging.name={name}", "logging.plot=false", *overrides]
    env = clean_env({"PYTHONPATH": str(REPO / "tests")})
    # A session of its own, so that a test can SIGKILL the whole launch.
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
                          start_new_session=True)


def read_run(tmp_path: Path, name: str) -> tuple[dict, list[dict]]:
    run = tmp_path / "runs" / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run / "summary.json").read_text()), rows


@pytest.mark.multiproc
def test_two_ranks_of_batch_b_match_one_rank_of_batch_2b(tmp_path):
    common = [*SMALL_SYNTHETIC, "training.epochs=2", "checkpoint.every_n_epochs=null"]
    one = torchrun_train(tmp_path, 1, [*common, "training.batch_size=32"], name="one")
    two = torchrun_train(tmp_path, 2, [*common, "training.batch_size=16"], name="two")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    (summary1, rows1), (summary2, rows2) = read_run(tmp_path, "one"), read_run(tmp_path, "two")
    assert summary2["world_size"] == 2 and summary2["effective_batch_size"] == summary1["effective_batch_size"]
    for row1, row2 in zip(rows1, rows2, strict=True):
        assert row2["train_loss"] == pytest.approx(row1["train_loss"], rel=1e-5)
        # 101 validation samples over 2 ranks: padding counted would move this.
        assert row2["val_loss"] == pytest.approx(row1["val_loss"], rel=1e-5)
        assert row2["val_accuracy"] == pytest.approx(row1["val_accuracy"], rel=1e-9)
    checksums = summary2["parameter_checksums_per_rank"]
    assert checksums[0] == checksums[1]
    assert checksums[0] == pytest.approx(summary1["parameter_checksums_per_rank"][0], rel=1e-5)


@pytest.mark.multiproc
def test_early_stopping_stops_every_rank_at_the_same_epoch(tmp_path):
    result = torchrun_train(tmp_path, 2, [*SMALL_SYNTHETIC, "training.epochs=10", "training.lr=1e-9",
                                          "validation.early_stopping.patience=2",
                                          "validation.early_stopping.min_delta=0.5"], name="es")
    assert result.returncode == 0, result.stderr[-3000:]
    summary, rows = read_run(tmp_path, "es")
    assert summary["stopped_early"] is True
    assert summary["epochs_run_per_rank"] == [3, 3]
    assert len(rows) == 3


@pytest.mark.multiproc
def test_all_engine_options_together_each_take_effect(tmp_path):
    probe = ["callbacks=[{target: 'engine_probe:EngineProbe', params: {decay: 0.9}}]"]
    result = torchrun_train(tmp_path, 2, [
        *SMALL_SYNTHETIC, "training.epochs=2", "training.grad_accum_steps=3", "training.grad_clip_norm=1.0",
        "training.optimizer=adamw", "training.zero_optimizer=true", "training.ema_decay=0.9",
        "training.precision=bf16", "training.scheduler.name=step", "training.scheduler.interval=epoch",
        "training.lr_scaling=linear", "distributed.comm_hook=fp16", "distributed.bucket_cap_mb=1",
        "distributed.gradient_as_bucket_view=true", "job.params.dropout=0.1", "data.num_workers=1",
        "checkpoint.every_n_steps=5", *probe], name="all")
    assert result.returncode == 0, result.stderr[-3000:]
    summary, _ = read_run(tmp_path, "all")
    assert summary["epochs_completed"] == 2 and summary["effective_batch_size"] == 2 * 64 * 3
    assert len(set(summary["parameter_checksums_per_rank"])) == 1
    state = load_checkpoint(tmp_path / "runs" / "all" / "checkpoints" / "last.pt")
    assert state["ema"] is not None and state["optimizer"]["state"]
    probes = [json.loads((tmp_path / "runs" / "all" / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    # ZeRO: AdamW keeps two moments per parameter; each rank holds only its shard of them.
    whole_state = 2 * probes[0]["parameters"]
    assert [p["optimizer_class"] for p in probes] == ["ZeroRedundancyOptimizer"] * 2
    assert sum(p["local_optimizer_state"] for p in probes) == whole_state
    assert all(0 < p["local_optimizer_state"] <= 0.75 * whole_state for p in probes), probes
    for p in probes:
        # EMA: the trainer's average is decay 0.9 over the live weights after every step, it
        # is not the live weights, and validation and test ran on it.
        assert p["ema_minus_predicted"] < 1e-5 and p["ema_minus_live"] > 1e-3, p
        assert p["evaluated"] == ["ema"]
        assert p["comm_hook"] == "fp16_compress_hook"  # the hook DDP reports it runs
        assert p["training_activations"] == ["torch.bfloat16"]  # bf16 autocast on CPU


RESUME_CONFIG = [*SMALL_SYNTHETIC, "training.epochs=3", "training.batch_size=16", "training.grad_accum_steps=2",
                 "training.optimizer=adamw", "training.scheduler.name=cosine", "training.scheduler.warmup=3",
                 "job.params.dropout=0.2", "training.deterministic=true",
                 "checkpoint.every_n_steps=3", "checkpoint.every_n_epochs=null", "checkpoint.keep_last=10"]


#: What training.md's "everything needed to continue exactly" names beyond the model and a
#: plain optimizer: ZeRO's optimizer state (consolidated on rank 0 for the file), the fp16
#: grad scaler and the EMA. dcp refuses ZeRO, so its variant trains without these.
EXACT_EXTRAS = ["training.zero_optimizer=true", "training.precision=fp16", "training.ema_decay=0.9"]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_resume_after_sigkill_mid_epoch_is_bit_identical(tmp_path, fmt):
    # 512 samples / 2 ranks / batch 16 = 16 micro-batches = 8 steps per epoch;
    # step 12 is the middle of the second epoch.
    config = [*RESUME_CONFIG, f"checkpoint.format={fmt}", *(EXACT_EXTRAS if fmt == "file" else [])]
    straight = torchrun_train(tmp_path, 2, config, name="straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    kill = ["callbacks=[{target: 'fault_injection:KillLaunchAfterCheckpoint', params: {step: 12}}]"]
    killed = torchrun_train(tmp_path, 2, [*config, *kill], name="resumed")
    assert killed.returncode != 0
    checkpoints = tmp_path / "runs" / "resumed" / "checkpoints"
    newest = load_last_checkpoint(checkpoints)["progress"]
    assert newest == {"epoch": 1, "batches_done": 8, "global_step": 12, "epoch_offset": 0}
    assert not (tmp_path / "runs" / "resumed" / "summary.json").exists()

    resumed = torchrun_train(tmp_path, 2, config, name="resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resuming from \S+step-00000012\S*: epoch 2, batch 8, step 12", resumed.stderr), \
        resumed.stderr[-3000:]

    a = load_last_checkpoint(tmp_path / "runs" / "straight" / "checkpoints")
    b = load_last_checkpoint(checkpoints)
    assert a["progress"] == {"epoch": 3, "batches_done": 0, "global_step": 24, "epoch_offset": 0}
    assert_same_training_state(a, b)
    assert a["scheduler"] == b["scheduler"]
    if fmt == "file":
        # ZeRO: rank 0's file holds every parameter's AdamW moments, not only its own shard.
        assert len(b["optimizer"]["state"]) == len(b["model"]) and all(
            set(state) >= {"exp_avg", "exp_avg_sq"} for state in b["optimizer"]["state"].values())
        # The scaler counts its steps since the last inf (24, none here): 12 had it not been restored.
        assert a["scaler"] == b["scaler"] and b["scaler"]["_growth_tracker"] == 24, b["scaler"]
        assert a["ema"].keys() == b["ema"].keys() and all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])
    if fmt == "dcp":  # every rank wrote its part: one shard file per rank, and its own RNG streams in it
        assert sorted(p.name for p in (checkpoints / "step-00000024").glob("*.distcp")) == ["__0_0.distcp",
                                                                                             "__1_0.distcp"]

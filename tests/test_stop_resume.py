"""Stopping to be continued, with real ranks under torchrun: resume on another world size
with every sample of the interrupted epoch trained once; stop ahead of the job's deadline
with no signal, then resume bit-identically."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import FIGURES, REPO, assert_same_training_state, clean_env
from ddp_hpc.engine.checkpoint.files import load_checkpoint
from stop_helpers import count_ids

pytestmark = [pytest.mark.reliability, pytest.mark.multiproc, pytest.mark.slow]


def assert_stopped_with_75(result: subprocess.CompletedProcess[str], nproc: int) -> None:
    """torchrun exits 1 when a worker ends non-zero; its summary gives each worker's status.
    The first rank to exit 75 makes torchrun SIGTERM the others, which may still be on their
    way out (after the barrier that follows the checkpoint), so those show 75 or -15."""
    assert result.returncode != 0, result.stderr[-3000:]
    codes = dict((pid, int(code)) for code, pid in re.findall(r"exitcode\s+:\s*(-?\d+) \(pid: (\d+)\)", result.stderr))
    assert len(codes) == nproc and 75 in codes.values() and set(codes.values()) <= {75, -15}, result.stderr[-3000:]


def torchrun(tmp_path: Path, nproc: int, config: str | Path, overrides: list[str], *, name: str,
             env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "ddp_hpc", "train", str(config), f"logging.run_dir={tmp_path / 'runs'}", f"logging.name={name}",
            "logging.progress=never", "logging.plot=false", *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env=clean_env({"PYTHONPATH": str(REPO / "tests"), **(env or {})}))


# 60 samples. On 2 ranks of batch 4: 30 per rank, 8 batches (the last of 2), 8 steps per
# epoch; stopped at step 11 = epoch 1 after 3 batches, i.e. 24 of its samples.
WORLD_SIZE_CONFIG = ["job.params.size=60", "training.epochs=3",
                     "training.batch_size=4", "training.optimizer=adam", "training.lr=0.01",
                     "training.lr_scaling=linear", "training.base_batch_size=8", "training.scheduler.name=cosine",
                     "training.scheduler.min_lr_ratio=0.1", "checkpoint.preemption_check_every_n_steps=1"]


def _record(folder: Path, *extra: str) -> str:
    callbacks = [f"{{target: 'stop_helpers:RecordIds', params: {{folder: '{folder}'}}}}", *extra]
    return f"callbacks=[{', '.join(callbacks)}]"


def test_resume_on_fewer_and_more_ranks_trains_every_sample_of_the_epoch_once(tmp_path):
    """Rank 1 alone requests the stop (docs/api.md: once any rank asked, every rank stops at
    the same step); the run is resumed on 1 and on 3 ranks."""
    runs, config = tmp_path / "runs", tmp_path / "recording.yaml"
    config.write_text("job:\n  name: 'stop_helpers:RecordingJob'\n")
    stopped = torchrun(tmp_path, 2, config, [
        *WORLD_SIZE_CONFIG, _record(tmp_path / "ids-2", "{target: 'stop_helpers:StopAtStep', params: {step: 11, rank: 1}}")],
        name="two")
    assert_stopped_with_75(stopped, 2)
    state = load_checkpoint(runs / "two" / "checkpoints" / "last.pt")
    assert state["progress"] == {"epoch": 1, "batches_done": 3, "global_step": 11, "epoch_offset": 0}
    assert state["world_size"] == 2

    # (ranks, steps left in epoch 1, steps of epoch 2, effective batch)
    for nproc, rest_steps, epoch_steps, effective in ((1, 9, 15, 4), (3, 3, 5, 12)):
        name = f"on{nproc}"
        shutil.copytree(runs / "two", runs / name)
        records = tmp_path / f"ids-{nproc}"
        resumed = torchrun(tmp_path, nproc, config, [*WORLD_SIZE_CONFIG, _record(records)], name=name)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert re.search(rf"written by 2 ranks, on {nproc}: effective batch 8 -> {effective} \(4 x {nproc} x 1\); "
                         rf"learning rate x {effective / 8:g} \(lr_scaling: linear\); epoch 2 continues after 24 of "
                         rf"its samples, the other 36 dealt out over {nproc} ranks", resumed.stderr), resumed.stderr[-3000:]

        counts = count_ids(tmp_path / "ids-2", records)
        assert counts[1] == Counter(range(60)), f"interrupted epoch on 2 then {nproc} ranks: {counts[1]}"
        assert counts[0] == Counter(range(60)) and counts[2] == Counter(range(60))

        final = load_checkpoint(runs / name / "checkpoints" / "last.pt")
        steps = 11 + rest_steps + epoch_steps
        assert final["progress"]["global_step"] == steps and final["world_size"] == nproc
        # The optimizer and schedule went on from step 11, and the schedule, re-planned for
        # the new effective batch, ends with the training.
        assert int(final["optimizer"]["state"][0]["step"]) == steps
        assert final["scheduler"]["last_epoch"] == steps
        base = 0.01 * effective / 8
        assert final["scheduler"]["base_lrs"] == [pytest.approx(base)]
        assert final["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1 * base)
    FIGURES.append("resume on another world size: 2 ranks stopped at step 11 (24 of 60 samples into epoch 2), "
                   "resumed on 1 and on 3 ranks: each of the 60 samples of that epoch trained exactly once")


DEADLINE_CONFIG = ["job.name=synthetic", "job.params.samples=512", "job.params.val_samples=101",
                   "job.params.input_dim=16", "job.params.hidden=32", "job.params.depth=2", "job.params.dropout=0.1",
                   "training.epochs=12", "training.batch_size=16", "training.optimizer=adamw",
                   "training.scheduler.name=cosine", "training.deterministic=true",
                   "checkpoint.preemption_check_every_n_steps=4", "checkpoint.deadline_margin_s=8"]


def test_deadline_stops_the_job_in_time_and_the_rerun_ends_bit_identical(tmp_path):
    config = str(REPO / "configs" / "synthetic.yaml")
    straight = torchrun(tmp_path, 2, config, DEADLINE_CONFIG, name="straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    # 16 steps per epoch, 12 epochs: at 0.25 s a step, well over the 25 s the job is given.
    deadline = time.time() + 25
    slow = "callbacks=[{target: 'stop_helpers:SlowSteps', params: {seconds: 0.25}}]"
    stopped = torchrun(tmp_path, 2, config, [*DEADLINE_CONFIG, slow], name="deadline",
                       env={"DDP_HPC_DEADLINE": f"{deadline:.3f}"})
    ended = time.time()
    assert_stopped_with_75(stopped, 2)
    assert "checkpointing and stopping at step" in stopped.stderr
    checkpoints = tmp_path / "runs" / "deadline" / "checkpoints"
    newest = max(checkpoints.glob("step-*.pt"))
    state = load_checkpoint(newest)
    step = state["progress"]["global_step"]
    assert step % 4 == 0 and 0 < step < 12 * 16, step
    assert f"stopping at step {step}" in stopped.stderr
    checkpointed = newest.stat().st_mtime
    assert checkpointed < deadline, "the checkpoint came after the deadline"
    assert ended < deadline, "the job ended after its deadline"

    resumed = torchrun(tmp_path, 2, config, DEADLINE_CONFIG, name="deadline")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {newest}" in resumed.stderr
    a = load_checkpoint(tmp_path / "runs" / "straight" / "checkpoints" / "last.pt")
    b = load_checkpoint(checkpoints / "last.pt")
    assert_same_training_state(a, b)
    assert a["scheduler"] == b["scheduler"]
    FIGURES.append(f"deadline stop (torchrun, 2 ranks, DDP_HPC_DEADLINE 25 s ahead, margin 8 s): checkpoint at "
                   f"step {step} {deadline - checkpointed:.1f} s before the deadline, job ended "
                   f"{deadline - ended:.1f} s before it; resumed run bit-identical")

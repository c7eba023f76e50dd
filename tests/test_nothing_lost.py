"""Kill the whole job at random moments, during checkpoint writes too: the newest checkpoint
always loads, and resuming always ends with the weights of an uninterrupted run."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIGURES, REPO, assert_same_training_state, clean_env
from fault_injection import kill_tree
from ddp_hpc.training.checkpoint import load_checkpoint, newest_loadable

pytestmark = [pytest.mark.multiproc, pytest.mark.reliability, pytest.mark.slow]
KILLS = 20
# 640 steps of ~40 ms, an 8 MB checkpoint after every one: most of the time is spent inside
# checkpoint writes, so random kills land in them often; 20 kills fit before the end.
CONFIG = ["job.params.samples=2048", "job.params.val_samples=64", "job.params.input_dim=256", "job.params.hidden=512",
          "job.params.depth=3", "job.params.dropout=0.1", "training.batch_size=16", "training.epochs=10",
          "training.optimizer=adamw", "training.deterministic=true", "checkpoint.every_n_steps=1",
          "checkpoint.every_n_epochs=1", "checkpoint.keep_last=2", "logging.progress=never",
          "validation.early_stopping.patience=null"]


def launch(tmp_path: Path, name: str, extra: list[str] = ()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ddp_hpc",
            "train", str(REPO / "configs" / "synthetic.yaml"), f"logging.run_dir={tmp_path / 'runs'}",
            f"logging.name={name}", *CONFIG, *extra]
    return subprocess.Popen(argv, env=clean_env({"PYTHONPATH": str(REPO / "tests")}), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_until_gone(root: int) -> None:
    """No rank of the killed launch may still be running (or writing) when the next starts."""
    deadline = time.monotonic() + 10
    while any("logging.name=killed" in _cmdline(pid) for pid in _pids()):
        assert time.monotonic() < deadline, f"ranks of launch {root} still run 10 s after the kill"
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:  # the process is gone
        return ""


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if "ddp_hpc" in _cmdline(int(p.name))]


def test_twenty_kills_lose_nothing(tmp_path):
    straight = launch(tmp_path, "straight")
    _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-3000:]
    reference = load_checkpoint(tmp_path / "runs" / "straight" / "checkpoints" / "last.pt")

    rng = random.Random(20261122)
    checkpoints = tmp_path / "runs" / "killed" / "checkpoints"
    kill_points, mid_write, started = [], 0, time.monotonic()
    for attempt in range(KILLS):
        if attempt % 4 == 3:  # every fourth kill lands inside a checkpoint write
            process = launch(tmp_path, "killed", [
                "callbacks=[{target: 'fault_injection:KillLaunchDuringCheckpointWrite', params: {nth: 2}}]"])
            process.wait(timeout=300)
            mid_write += 1
            kill_points.append("mid-write")
        else:
            process = launch(tmp_path, "killed")
            delay = rng.uniform(3.0, 4.5)  # start-up takes ~2.7 s: 0.3-1.8 s of training
            try:
                process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                kill_tree(process.pid)
                process.wait()
            kill_points.append(f"{delay:.1f}s")
        assert process.returncode != 0, "the run finished before kill %d landed" % (attempt + 1)
        wait_until_gone(process.pid)
        newest = newest_loadable(checkpoints)
        written = list(checkpoints.glob("*.pt"))
        assert newest is not None or not written  # nothing loads only if nothing was written yet
        leftovers = [p.name for p in checkpoints.glob(".*")]
        assert all(".tmp-" in name for name in leftovers), leftovers
        for path in checkpoints.glob("*.pt"):
            load_checkpoint(path)  # every visible checkpoint file is whole

    assert len(kill_points) == KILLS
    resumed_from = newest_loadable(checkpoints)[1]["progress"]["global_step"]
    final = launch(tmp_path, "killed")
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]
    assert list(checkpoints.glob(".*")) == []  # interrupted writes' temporaries are cleaned up
    assert_same_training_state(reference, load_checkpoint(checkpoints / "last.pt"))
    FIGURES.append(f"nothing lost: {len(kill_points)} kills ({mid_write} injected inside checkpoint writes, the "
                   f"others at random times: {', '.join(p for p in kill_points if p != 'mid-write')}); "
                   f"resumed from step {resumed_from}; final weights bit-identical; {time.monotonic() - started:.0f}s")

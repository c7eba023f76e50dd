"""Kill the whole job at random moments, during checkpoint writes too: the newest checkpoint
always loads, and resuming always ends with the weights of an uninterrupted run."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import FIGURES, REPO, assert_same_training_state, clean_env
from fault_injection import kill_tree
from ddp_hpc.engine.checkpoint.files import load_checkpoint, newest_loadable

pytestmark = [pytest.mark.multiproc, pytest.mark.reliability, pytest.mark.slow]
# 64 steps of ~40 ms per epoch, an 8 MB checkpoint after every one: most of the time is
# spent inside checkpoint writes, so random kills land in them often. Each kill costs at
# most 1.5 s of training, so the epochs of each case leave room for all its kills.
CONFIG = ["job.params.samples=2048", "job.params.val_samples=64", "job.params.input_dim=256", "job.params.hidden=512",
          "job.params.depth=3", "job.params.dropout=0.1", "training.batch_size=16",
          "training.optimizer=adamw", "training.deterministic=true", "checkpoint.every_n_steps=1",
          "checkpoint.every_n_epochs=1", "checkpoint.keep_last=2", "logging.progress=never", "logging.plot=false",
          "validation.early_stopping.patience=null"]


def launch(tmp_path: Path, name: str, epochs: int, extra: list[str] = ()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ddp_hpc",
            "train", str(REPO / "configs" / "synthetic.yaml"), f"logging.run_dir={tmp_path / 'runs'}",
            f"logging.name={name}", *CONFIG, f"training.epochs={epochs}", *extra]
    return subprocess.Popen(argv, env=clean_env({"PYTHONPATH": str(REPO / "tests")}), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


class LogWatch:
    """Reads a launch's stderr as it comes (so the pipe never fills) and signals when a
    line containing ``text`` has appeared."""

    def __init__(self, process: subprocess.Popen, text: str) -> None:
        self.lines: list[str] = []
        self.seen = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(process, text), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen, text: str) -> None:
        for line in process.stderr:
            self.lines.append(line)
            if text in line:
                self.seen.set()

    def tail(self) -> str:
        return "".join(self.lines[-40:])


# Rank 0 logs this after resuming and removing stale temporaries, right before training.
TRAINING_STARTS = "INFO ddp_hpc.training.trainer: run folder:"


def wait_until_gone(root: int, run_dir: Path) -> None:
    """No rank of the killed launch may still be running (or writing) when the next starts.
    Its ranks are told apart by their run folder, which no other test (on another xdist
    worker, or in another checkout) shares."""
    deadline = time.monotonic() + 10
    while any(f"logging.run_dir={run_dir}" in _cmdline(pid) for pid in _pids()):
        assert time.monotonic() < deadline, f"ranks of launch {root} still run 10 s after the kill"
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:  # the process is gone
        return ""


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if "ddp_hpc" in _cmdline(int(p.name))]


@pytest.mark.parametrize("kills, every, epochs", [
    # CI: a random kill, then one inside the 2nd write of its launch; the final launch must
    # remove the temporary that kill left (4 launches: 1-2 minutes on a loaded 2-core machine).
    pytest.param(2, 2, 3, id="2-kills", marks=pytest.mark.timeout(450)),
    # 15 random kills and 5 inside the 1st to 4th write of their launch (21 launches).
    pytest.param(20, 4, 10, id="20-kills", marks=[pytest.mark.acceptance, pytest.mark.timeout(900)]),
])
def test_repeated_kills_lose_nothing(tmp_path, kills, every, epochs):
    # The uninterrupted reference checkpoints once per epoch only (saving changes nothing in
    # the training, as the bit-identical end shows): 64 fewer 8 MB writes per epoch.
    straight = launch(tmp_path, "straight", epochs, ["checkpoint.every_n_steps=null"])
    _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-3000:]
    reference = load_checkpoint(tmp_path / "runs" / "straight" / "checkpoints" / "last.pt")

    rng = random.Random(20261122)
    checkpoints = tmp_path / "runs" / "killed" / "checkpoints"
    kill_points, mid_write, started = [], 0, time.monotonic()
    left_behind: list[str] = []  # temporaries of interrupted writes, to be removed by the next start
    for attempt in range(kills):
        if attempt % every == every - 1:  # every ``every``-th kill lands inside a checkpoint write
            # The 1st to 4th write of this launch; CI's one such kill takes the 2nd, so that a
            # checkpoint is there to resume from even where the random kill before it came
            # before any write.
            nth = 2 if kills <= every else 1 + (attempt // every) % 4
            process = launch(tmp_path, "killed", epochs, [
                f"callbacks=[{{target: 'fault_injection:KillLaunchDuringCheckpointWrite', params: {{nth: {nth}}}}}]"])
            watch = LogWatch(process, TRAINING_STARTS)
            process.wait(timeout=300)
            mid_write += 1
            kill_points.append(f"inside write {nth}")
        else:
            process = launch(tmp_path, "killed", epochs)
            watch = LogWatch(process, TRAINING_STARTS)
            assert watch.seen.wait(timeout=120), "training never started:\n" + watch.tail()
            delay = rng.uniform(0.1, 1.5)  # after training started, not after a fixed start-up guess
            try:
                process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                kill_tree(process.pid)
                process.wait()
            kill_points.append(f"{delay:.1f}s")
        assert process.returncode != 0, "the run finished before kill %d landed" % (attempt + 1)
        watch.thread.join(timeout=10)
        assert watch.seen.is_set(), "the kill landed before training started:\n" + watch.tail()
        wait_until_gone(process.pid, tmp_path / "runs")
        temporaries = sorted(p.name for p in checkpoints.glob(".*"))
        assert all(".tmp-" in name for name in temporaries), temporaries
        assert not set(left_behind) & set(temporaries), "the previous start did not remove " + str(left_behind)
        if kill_points[-1].startswith("inside"):
            # The kill came between the temporary's fsync and its rename: it is still there.
            assert [n for n in temporaries if n.startswith(".step-")], f"no temporary left: {temporaries}"
        left_behind = temporaries
        newest = newest_loadable(checkpoints)
        written = list(checkpoints.glob("*.pt"))
        assert newest is not None or not written  # nothing loads only if nothing was written yet
        for path in checkpoints.glob("*.pt"):
            load_checkpoint(path)  # every visible checkpoint file is whole

    newest, saved = newest_loadable(checkpoints)
    final = launch(tmp_path, "killed", epochs)
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]
    # What the final launch itself says it restored (a silent start-over also ends bit-identical).
    progress = saved["progress"]
    resumed = re.findall(r"resuming from (\S+): epoch (\d+), batch (\d+), step (\d+)", err)
    assert resumed == [(str(newest), str(progress["epoch"] + 1), str(progress["batches_done"]),
                        str(progress["global_step"]))], err[-3000:]
    resumed_from = progress["global_step"]
    assert list(checkpoints.glob(".*")) == []  # interrupted writes' temporaries are cleaned up
    assert_same_training_state(reference, load_checkpoint(checkpoints / "last.pt"))
    FIGURES.append(f"nothing lost: {len(kill_points)} kills ({mid_write} injected inside checkpoint writes, between "
                   f"the temporary's fsync and its rename; the others at random times after training started: "
                   f"{', '.join(p for p in kill_points if not p.startswith('inside'))}); "
                   f"resumed from step {resumed_from}; final weights bit-identical; {time.monotonic() - started:.0f}s")

"""``checkpoint.async: true``: training waits only for the snapshot; the background write keeps
every guarantee of a synchronous save (atomic files, last.pt always complete, exact resume)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FIGURES, REPO, assert_same_training_state, clean_env
from slow_save import trickling
from ddp_hpc.engine.checkpoint import files as ckpt
from ddp_hpc.engine.checkpoint.background_writer import AsyncCheckpointWriter, CheckpointWriteError
from ddp_hpc.engine.checkpoint.host_copy import snapshot


def _state(step: int, weights: torch.Tensor) -> dict:
    return {"format": ckpt.FORMAT_VERSION, "model": {"w": weights},
            "progress": {"epoch": 0, "batches_done": step, "global_step": step}}


def _slow_torch_save(monkeypatch, chunks: int = 40, pause_s: float = 0.005) -> None:
    """torch.save that trickles the file out, so a write stays half done for a while."""
    monkeypatch.setattr(ckpt.torch, "save", trickling(torch.save, chunks, pause_s))


@pytest.mark.reliability
def test_last_pt_never_points_at_an_incomplete_file(tmp_path, monkeypatch):
    _slow_torch_save(monkeypatch)
    writer = AsyncCheckpointWriter()
    live = torch.zeros(50_000)
    seen: set[int] = set()
    polls = in_flight_polls = 0
    for step in range(1, 7):
        live.fill_(float(step))
        path = ckpt.step_path(tmp_path, step)
        writer.submit(_state(step, live), path,
                      lambda state, path=path: ckpt.write_checkpoint(state, path, best=False, keep_last=2))
        live.fill_(-1.0)  # training goes on: the snapshot must not see this
        while writer.in_flight:
            polls += 1
            in_flight_polls += 1
            last = tmp_path / "last.pt"
            if last.exists():
                state = ckpt.load_checkpoint(last)  # raises on a partial file
                done = state["progress"]["global_step"]
                assert done in (step - 1, step), (done, step)
                assert torch.equal(state["model"]["w"], torch.full((50_000,), float(done)))
                seen.add(done)
            time.sleep(0.001)
    writer.wait()
    assert ckpt.load_checkpoint(tmp_path / "last.pt")["progress"]["global_step"] == 6
    assert in_flight_polls > 20, "the writes were never observed in flight: the test checked nothing"
    assert len(seen) >= 3, seen
    assert [p.name for p in ckpt.periodic_checkpoints(tmp_path)] == ["step-00000005.pt", "step-00000006.pt"]
    assert [p.name for p in tmp_path.glob(".*")] == []


def test_one_write_in_flight_and_errors_reach_the_training_thread(tmp_path, monkeypatch):
    _slow_torch_save(monkeypatch, chunks=20, pause_s=0.01)
    writer = AsyncCheckpointWriter()
    first = ckpt.step_path(tmp_path, 1)
    writer.submit(_state(1, torch.ones(3)), first, lambda s: ckpt.write_checkpoint(s, first, best=True, keep_last=3))
    assert writer.in_flight
    second = ckpt.step_path(tmp_path, 2)
    finished = writer.submit(_state(2, torch.ones(3)), second,
                             lambda s: ckpt.write_checkpoint(s, second, best=False, keep_last=3))
    assert [r.path for r in finished] == [first]  # the second submit waited for the first
    assert first.exists()
    assert [r.path for r in writer.wait()] == [second]

    def disk_full(state):
        raise OSError(28, "No space left on device")

    writer.submit(_state(3, torch.ones(3)), tmp_path / "x.pt", disk_full)
    with pytest.raises(CheckpointWriteError, match="x.pt failed: OSError.*No space left"):
        writer.wait()


def test_snapshot_shares_no_memory_with_the_live_state():
    weights, moments = torch.arange(4.0), {"state": {0: {"exp_avg": torch.ones(2)}}, "lr": [0.1]}
    copied = snapshot({"model": {"w": weights}, "optimizer": moments, "history": [{"epoch": 1}]})
    weights.add_(10)
    moments["state"][0]["exp_avg"].zero_()
    moments["lr"].append(0.2)
    assert torch.equal(copied["model"]["w"], torch.arange(4.0))
    assert torch.equal(copied["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    assert copied["optimizer"]["lr"] == [0.1]


TRAIN = ["train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=2048", "job.params.val_samples=64",
         "job.params.input_dim=64", "job.params.hidden=256", "job.params.depth=2", "job.params.dropout=0.1",
         "training.batch_size=16", "training.epochs=2", "training.optimizer=adamw", "training.deterministic=true",
         "checkpoint.every_n_steps=16", "checkpoint.every_n_epochs=1", "checkpoint.async=true",
         "checkpoint.keep_last=10", "logging.progress=never", "logging.plot=false", "validation.early_stopping.patience=null"]


def _train(tmp_path: Path, name: str, extra: list[str] = ()) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ddp_hpc",
            *TRAIN, f"logging.run_dir={tmp_path / 'runs'}", f"logging.name={name}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=clean_env({"PYTHONPATH": str(REPO / "tests")}))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.reliability
def test_a_kill_during_the_background_write_resumes_bit_identically(tmp_path):
    straight = _train(tmp_path, "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = ckpt.load_checkpoint(tmp_path / "runs" / "straight" / "checkpoints" / "last.pt")

    marker = tmp_path / "kill.json"
    killed = _train(tmp_path, "killed", [
        f"callbacks=[{{target: 'fault_injection:KillLaunchDuringAsyncWrite', params: {{nth: 3, marker: '{marker}'}}}}]"])
    assert killed.returncode != 0, "the run finished before the kill"
    assert marker.exists(), "the kill was never injected:\n" + killed.stderr[-3000:]
    kill = json.loads(marker.read_text())
    # The kill landed in the background writer, mid-write, while training had moved on.
    assert kill["thread"] == "ddp_hpc-checkpoint-writer" and not kill["main_thread"]
    assert kill["checkpoint_step"] == 48 and kill["training_step_at_kill"] > 48, kill
    assert kill["temporary_bytes"] > 0
    checkpoints = tmp_path / "runs" / "killed" / "checkpoints"
    assert Path(kill["temporary"]).exists() and not ckpt.step_path(checkpoints, 48).exists()
    newest_path, newest = ckpt.newest_loadable(checkpoints)
    assert newest_path.name == "step-00000032.pt" and newest["progress"]["global_step"] == 32
    assert ckpt.load_checkpoint(checkpoints / "last.pt")["progress"]["global_step"] == 32

    resumed = _train(tmp_path, "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "step 32" in resumed.stderr
    assert list(checkpoints.glob(".*")) == []
    assert_same_training_state(reference, ckpt.load_checkpoint(checkpoints / "last.pt"))
    FIGURES.append(f"async checkpoint: killed in the background write of step 48 while training was at step "
                   f"{kill['training_step_at_kill']}; resumed from step 32; final weights bit-identical")


def test_snapshot_refills_its_host_buffers_in_place():
    cache: dict = {}
    live = {"model": {"w": torch.zeros(8)}, "optimizer": {"state": {0: {"m": torch.ones(2)}}}}
    first = snapshot(live, cache)
    live["model"]["w"].fill_(3.0)
    second = snapshot(live, cache)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # reused, not reallocated
    assert torch.equal(second["model"]["w"], torch.full((8,), 3.0))
    live["model"]["w"] = torch.zeros(9)  # another shape: a new buffer
    assert snapshot(live, cache)["model"]["w"].shape == (9,)


def test_prestaged_buffers_are_the_ones_the_first_snapshot_fills(tmp_path):
    writer = AsyncCheckpointWriter()
    live = {"model": {"w": torch.randn(64)}, "optimizer": {"state": {0: {"m": torch.randn(4, 4)}}, "lr": 0.1}}
    writer.prestage({"model": live["model"], "optimizer": live["optimizer"]})
    assert writer.staged
    writer.wait()
    staged = {key: tensor.data_ptr() for key, tensor in writer._host_buffers.items()}
    assert set(staged) == {("model", "w"), ("optimizer", "state", 0, "m")}
    writer.submit({**live, "progress": {"step": 1}}, tmp_path / "a.pt", lambda state: ckpt.write_checkpoint(
        state, path=tmp_path / "a.pt", best=False, keep_last=2))
    writer.wait()
    assert {key: writer._host_buffers[key].data_ptr() for key in staged} == staged  # filled, not reallocated
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["model"]["w"], live["model"]["w"])

"""Checkpoint files: atomic writes, safe loading, fallbacks and model matching."""

from __future__ import annotations

import os
import pickle
import subprocess
import re
from pathlib import Path
import time

import pytest
import torch
from torch import nn

from ddp_hpc.engine.checkpoint import files as ckpt


def _state(step: int) -> dict:
    return {"format": ckpt.FORMAT_VERSION, "step": step, "extras": {"at": step},
            "model": {"w": torch.full((3,), float(step))},
            "progress": {"epoch": 0, "batches_done": step, "global_step": step}}


class _Held:
    """An object a Checkpointer saves and restores: the state it was last given."""

    def __init__(self, value: dict | None = None) -> None:
        self.value = value

    def state_dict(self) -> dict | None:
        return self.value

    def load_state_dict(self, value: dict) -> None:
        self.value = value


def _resume(folder: Path, **kwargs):
    """What a run over ``folder`` (a checkpoints folder) resumes from: a Checkpointer's
    ``restore``, with what it loaded into its one object ``model``."""
    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer

    held = _Held()
    checkpointer = Checkpointer(folder.parent, {"model": held}, **kwargs)
    assert checkpointer.directory == folder
    return checkpointer.restore(), checkpointer, held


def test_save_then_load(tmp_path):
    path = ckpt.save_atomic(_state(5), tmp_path / "step-00000005.pt")
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.full((3,), 5.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005.pt"]  # no temp file left


@pytest.mark.reliability
def test_an_exception_while_writing_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ckpt.save_atomic(_state(1), path)

    def crash(obj, handle):
        handle.write(b"PK\x03\x04half a zip")
        raise KeyboardInterrupt("interrupted mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_atomic(_state(2), path)
    monkeypatch.undo()
    assert ckpt.load_checkpoint(path)["progress"]["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # an exception runs the clean-up


# A child writes checkpoint 1, prints its size, then writes checkpoint 2 of the same size.
_WRITER_CHILD = """
import sys, torch
from pathlib import Path
from ddp_hpc.engine.checkpoint import files as ckpt
folder = Path(sys.argv[1])
def state(step):
    return {"format": ckpt.FORMAT_VERSION, "step": step, "extras": {"at": step}, "model": {f"w{i}": torch.full((1 << 18,), float(step)) for i in range(32)},
            "progress": {"epoch": 0, "batches_done": step, "global_step": step}}
first = ckpt.write_checkpoint(state(1), ckpt.step_path(folder, 1), best=False, keep_last=3)
print(first.stat().st_size, flush=True)
# Checkpoint 2's bytes go out in 32 flushed pieces over about 0.6 s, as a slow file system
# would write them: a window the parent, however loaded, sees the temporary partly written in.
sys.path.insert(0, sys.argv[2])
from slow_save import trickling
ckpt.torch.save = trickling(torch.save, 32, 0.02)
ckpt.write_checkpoint(state(2), ckpt.step_path(folder, 2), best=False, keep_last=3)
print("finished", flush=True)
"""

#: How each checkpoint format is written by a child that the test kills mid-write. Sharded
#: checkpoints (one file per rank) join here once they exist, with their own child script.
WRITERS = {"single file": _WRITER_CHILD}


def _kill_while_the_temporary_is_partly_written(folder: Path, child_script: str) -> tuple[Path, int, int] | None:
    """Start the child, SIGKILL it as soon as checkpoint 2's temporary holds some but not all
    of its bytes; the temporary, the size seen before the kill and checkpoint 1's size (None:
    the child ended before a poll saw it partly written)."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", child_script, str(folder), str(Path(__file__).parent)],
                             stdout=subprocess.PIPE, text=True)
    try:
        first = child.stdout.readline()
        assert first.strip().isdigit(), f"the child did not write checkpoint 1 (exit status {child.wait(timeout=60)})"
        final = int(first)
        pattern = f".{ckpt.step_path(folder, 2).name}.tmp-{child.pid}*"  # the child's temporary for checkpoint 2
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            temporary = next(folder.glob(pattern), None)
            try:
                seen = temporary.stat().st_size if temporary else 0
            except FileNotFoundError:
                continue
            if 0 < seen < final:
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=30)
                return temporary, seen, final
        assert child.poll() is not None, f"{pattern} not partly written within 60 s"
        return None
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()


@pytest.mark.reliability
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_sigkill_while_the_temporary_is_half_written_resumes_from_the_previous_checkpoint(tmp_path, writer):
    temporary, seen, final = None, 0, 0
    for attempt in range(3):  # the kill lands a moment after the size was read: rarely, the write has ended
        folder = tmp_path / f"attempt-{attempt}" / "checkpoints"
        folder.mkdir(parents=True)
        killed = _kill_while_the_temporary_is_partly_written(folder, WRITERS[writer])
        if killed is None:
            continue  # the write ended between two polls
        temporary, seen, final = killed
        if temporary.exists() and temporary.stat().st_size < final:
            break
    assert temporary is not None and 0 < seen < final, "in 3 tries, never killed the child mid-write"
    left = temporary.stat().st_size  # a SIGKILL runs no clean-up: the partial temporary stays
    assert 0 < left < final, (left, final)
    assert not ckpt.step_path(folder, 2).exists()
    assert ckpt.load_checkpoint(folder / "last.pt")["progress"]["global_step"] == 1
    path, checkpointer, held = _resume(folder)  # what the next run does
    assert path == ckpt.step_path(folder, 1) and checkpointer.step == 1 and checkpointer.extras == {"at": 1}
    assert sorted(held.value) == sorted(f"w{i}" for i in range(32))
    assert all(torch.equal(w, torch.full((1 << 18,), 1.0)) for w in held.value.values())
    assert not temporary.exists()  # the half-written temporary is removed, never read


@pytest.mark.reliability
def test_truncated_newest_is_reported_and_the_previous_used(tmp_path, caplog):
    for step in (10, 20, 30):
        ckpt.save_atomic(_state(step), ckpt.step_path(tmp_path, step))
    newest = ckpt.step_path(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:100])
    path, state = ckpt.newest_loadable(tmp_path)
    assert path.name == "step-00000020.pt" and state["progress"]["global_step"] == 20
    assert "step-00000030.pt is unreadable (truncated or corrupt" in caplog.text


def test_no_checkpoint_at_all(tmp_path):
    assert ckpt.newest_loadable(tmp_path) is None
    assert ckpt.newest_loadable(tmp_path / "missing") is None


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.reliability
def test_a_checkpoint_carrying_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format": ckpt.FORMAT_VERSION, "model": _Payload()}, path)
    with pytest.raises(ckpt.CheckpointError, match="holds objects other than tensors"):
        ckpt.load_checkpoint(path)


def test_plain_pickle_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "x.pt"
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_checkpoint(path)


def test_links_and_pruning(tmp_path):
    for step in range(1, 6):
        path = ckpt.save_atomic(_state(step), ckpt.step_path(tmp_path, step))
        ckpt.link_atomic(path, tmp_path / "last.pt")
        if step == 2:
            ckpt.link_atomic(path, tmp_path / "best.pt")
        ckpt.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.pt", "last.pt", "step-00000004.pt", "step-00000005.pt"]
    assert ckpt.load_checkpoint(tmp_path / "best.pt")["progress"]["global_step"] == 2
    assert ckpt.load_checkpoint(tmp_path / "last.pt")["progress"]["global_step"] == 5


def test_module_prefixed_state_dict_loads_into_a_plain_model():
    model = nn.Sequential(nn.Linear(2, 3))
    prefixed = {f"module.{k}": v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(ckpt.adapt_state_dict(prefixed, model, "x.pt"))
    assert torch.equal(model[0].bias, prefixed["module.0.bias"])


def test_plain_state_dict_loads_into_a_wrapped_model():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 3)

    wrapper = Wrapper()
    plain = {k: v.clone() for k, v in nn.Linear(2, 3).state_dict().items()}
    wrapper.load_state_dict(ckpt.adapt_state_dict(plain, wrapper, "x.pt"))
    assert torch.equal(wrapper.module.weight, plain["weight"])


def test_another_model_is_refused_with_the_key_named():
    with pytest.raises(ckpt.CheckpointError, match=r"0.weight has shape \[4, 2\] there but \[3, 2\] here"):
        ckpt.adapt_state_dict(nn.Sequential(nn.Linear(2, 4)).state_dict(), nn.Sequential(nn.Linear(2, 3)), "x.pt")
    with pytest.raises(ckpt.CheckpointError, match="missing 1.bias, 1.weight"):
        ckpt.adapt_state_dict(nn.Sequential(nn.Linear(2, 3)).state_dict(),
                              nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)), "x.pt")


def test_stale_temporaries_are_removed(tmp_path):
    ckpt.save_atomic(_state(1), tmp_path / "step-00000001.pt")
    (tmp_path / ".step-00000002.pt.tmp-4242").write_bytes(b"half")
    assert ckpt.remove_stale_temporaries(tmp_path) == [".step-00000002.pt.tmp-4242"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]


@pytest.mark.reliability
def test_when_no_checkpoint_can_be_read_nothing_starts_over_and_nothing_is_deleted(tmp_path):
    for step in (10, 20):
        path = ckpt.save_atomic(_state(step), ckpt.step_path(tmp_path, step))
        ckpt.link_atomic(path, tmp_path / "last.pt")
    for path in tmp_path.iterdir():
        path.write_bytes(path.read_bytes()[:100])  # truncates both names of step 20 (a hard link)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.newest_loadable(tmp_path)
    assert str(caught.value) == (f"none of the 3 checkpoint(s) in {tmp_path} can be read (step-00000020.pt, "
                                 "step-00000010.pt, last.pt); nothing was deleted: restore them, or start over with "
                                 "checkpoint.resume=never")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.reliability
def test_pruning_keeps_the_newest_readable_checkpoint_after_resuming_from_an_older_one(tmp_path):
    for step in (10, 30, 40):
        ckpt.save_atomic(_state(step), ckpt.step_path(tmp_path, step))
    for step in (30, 40):  # unreadable: the run resumed from step 10
        path = ckpt.step_path(tmp_path, step)
        path.write_bytes(path.read_bytes()[:100])
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for path in tmp_path.glob("step-*"):
        path.rename(folder / path.name)
    path, checkpointer, held = _resume(folder, keep_last=2)
    assert path.name == "step-00000010.pt" and checkpointer.step == 10 and checkpointer.extras == {"at": 10}
    assert torch.equal(held.value["w"], torch.full((3,), 10.0))
    time.sleep(0.02)  # coarse file-system clocks
    checkpointer.step_done()
    assert checkpointer.save(wait=True) == ckpt.step_path(folder, 11)  # pruned: by step alone, it went
    # The refused 30 and 40 neither count toward keep_last nor go: 10 and 11 are the 2 kept.
    assert sorted(p.name for p in folder.glob("step-*.pt")) == ["step-00000010.pt", "step-00000011.pt",
                                                                "step-00000030.pt", "step-00000040.pt"]
    assert ckpt.newest_loadable(folder)[0].name == "step-00000011.pt"


def test_a_checkpoint_of_another_job_is_refused(tmp_path):
    path = tmp_path / "step-00000010.pt"
    state = {**_state(10), "config": {"job": {"name": "synthetic"}}}
    with pytest.raises(ckpt.CheckpointError, match=r"was written by job 'synthetic', this run's job is 'digits'"):
        ckpt.check_same_job((path, state), "digits")
    assert ckpt.check_same_job((path, state), "synthetic") == (path, state)


@pytest.mark.reliability
def test_a_run_whose_checkpoints_are_all_truncated_stops_and_keeps_them(tmp_path):
    from conftest import REPO, ddp_hpc_command, run

    args = ["train", str(REPO / "configs" / "digits.yaml"), "training.epochs=1", f"logging.run_dir={tmp_path}",
            "logging.progress=never", "logging.plot=false"]
    first = run([*ddp_hpc_command(), *args])
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = tmp_path / "digits" / "checkpoints"
    for path in checkpoints.glob("*.pt"):  # the checkpoint files (each rank's part lies in step-N.ranks/)
        path.write_bytes(path.read_bytes()[:64])
    before = {p.name: p.read_bytes() for p in (tmp_path / "digits").rglob("*") if p.is_file()}
    again = run([*ddp_hpc_command(), *args])
    assert again.returncode == 2
    errors = [line for line in again.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and re.fullmatch(
        rf"ddp-hpc: error: none of the \d checkpoint\(s\) in {re.escape(str(checkpoints))} can be read \(.*\); "
        r"nothing was deleted: restore them, or start over with checkpoint.resume=never", errors[0]), again.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "digits").rglob("*") if p.is_file()} == before


@pytest.fixture
def small_tmpfs(tmp_path):
    """A file system of a chosen size (root only: ``mount -t tmpfs``), unmounted afterwards."""
    import shutil
    import subprocess

    from conftest import need

    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        folder = tmp_path / "tmpfs"
        folder.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)],
                                capture_output=True, text=True) if shutil.which("mount") and os.geteuid() == 0 else None
        need(result is not None and result.returncode == 0, "mounting a tmpfs needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


@pytest.mark.reliability
def test_a_checkpoint_that_does_not_fit_ends_the_run_with_one_line_and_keeps_the_previous(tmp_path, small_tmpfs):
    from conftest import FIGURES, REPO, ddp_hpc_command, run

    args = ["train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=256", "job.params.val_samples=0",
            "job.params.input_dim=128", "job.params.hidden=256", "job.params.depth=2", "training.batch_size=64",
            "training.epochs=3", "checkpoint.every_n_epochs=1", "checkpoint.keep_last=1", "checkpoint.save_best=false", "logging.progress=never",
            "logging.plot=false", "logging.name=full"]
    sized = run([*ddp_hpc_command(), *args, "training.epochs=1", f"logging.run_dir={tmp_path / 'sizing'}"])
    assert sized.returncode == 0, sized.stderr[-2000:]
    size = (tmp_path / "sizing" / "full" / "checkpoints" / "last.pt").stat().st_size
    disk = small_tmpfs(size * 3 // 2)  # room for one checkpoint, not for a second beside it
    result = run([*ddp_hpc_command(), *args, f"logging.run_dir={disk}"])
    checkpoints = disk / "full" / "checkpoints"
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and re.fullmatch(
        rf"ddp-hpc: error: cannot write checkpoint {re.escape(str(checkpoints))}/step-\d+\.pt: No space left on "
        rf"device; the previous checkpoint is kept: free space in {re.escape(str(checkpoints))} and rerun to resume",
        errors[0]), result.stderr[-2000:]
    path, state = ckpt.newest_loadable(checkpoints)
    assert state["progress"]["epoch"] == 1, path  # the first epoch's checkpoint, whole
    assert [p.name for p in checkpoints.glob(".*")] == []  # the partial temporary was removed
    FIGURES.append(f"full disk: a {size / 1e6:.1f} MB checkpoint on a {size * 3 // 2 / 1e6:.1f} MB tmpfs ended the "
                   f"run with exit 2 and one line; the previous checkpoint ({path.name}) loads")


#: tests/data/presplit/: checkpoints the Trainer wrote before it was split onto the
#: Checkpointer (its README says how they were made); this config is the one they were made with.
PRESPLIT = Path(__file__).parent / "data" / "presplit"
PRESPLIT_CONFIG = ["job.name=synthetic", "job.params.samples=40", "job.params.val_samples=8",
                   "job.params.input_dim=4", "job.params.hidden=8", "job.params.depth=1",
                   "job.params.dropout=0.2", "training.epochs=2", "training.batch_size=4",
                   "training.grad_accum_steps=2", "training.optimizer=adamw", "training.lr=0.01",
                   "training.scheduler.name=cosine", "training.scheduler.warmup=2", "training.deterministic=true",
                   "checkpoint.every_n_epochs=null", "checkpoint.keep_last=1", "checkpoint.save_best=false",
                   "checkpoint.preemption_check_every_n_steps=1", "logging.progress=never"]


def _fit_synthetic(tmp_path: Path, name: str, overrides: list[str], callbacks=(), before_fit=None):
    from ddp_hpc.config import load_config
    from ddp_hpc.startup.distributed import process_group
    from ddp_hpc.training.run_folder import RunFolder
    from ddp_hpc.training.job import create_job
    from ddp_hpc.training.trainer import Trainer

    config = load_config(None, [*PRESPLIT_CONFIG, f"logging.run_dir={tmp_path}", f"logging.name={name}",
                                "logging.plot=false", *overrides])
    with process_group(environ={}) as ctx:
        job = create_job(config.job.name, config.job.params)
        trainer = Trainer(job, config, ctx, RunFolder(tmp_path / name), callbacks)
        if before_fit is not None:
            before_fit(trainer)
        return trainer.fit()


def _rank_streams(checkpoint: Path) -> dict:
    """Rank 0's RNG streams as a checkpoint (either format, either layout) holds them."""
    import torch

    from ddp_hpc.engine.checkpoint.dcp_read import check_complete, read_blob

    if checkpoint.is_dir():
        return read_blob(checkpoint, check_complete(checkpoint), "ddp_hpc.rank.00000")["rng"]
    return torch.load(checkpoint.with_suffix(".ranks") / "rank-00000.pt", weights_only=True)["rng"]


def _same_streams(a: dict, b: dict) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_streams(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_streams, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a).__module__ == "numpy":
        import numpy as np

        return bool(np.array_equal(a, b))
    return a == b


@pytest.mark.reliability
@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_checkpoint_written_before_the_trainer_split_resumes_bit_identically(tmp_path, fmt, caplog):
    """The stored pre-split checkpoints' weights were computed on another processor and may
    differ from this one's by an ulp (another reduction order), so the reference is computed
    here: the same run stopped at the same step in today's layout. The upgrade must give its
    step, sampler position and RNG streams exactly; resumed from it with the stored weights
    loaded, it ends bit-identical to the resume from the pre-split checkpoint."""
    import logging
    import shutil

    import torch

    from conftest import assert_same_training_state, load_last_checkpoint
    from ddp_hpc.summary import RunStatus
    from ddp_hpc.training.checkpoint_upgrade import upgrade_presplit
    from stop_helpers import StopAtStep

    # Stopped on request by the pre-split Trainer in epoch 2 after 4 of its 10 micro-batches.
    stored_path = PRESPLIT / fmt / ("step-00000007" if fmt == "dcp" else "step-00000007.pt")
    stored = load_last_checkpoint(PRESPLIT / fmt)
    # The same run here, stopped on request at the same step: today's layout.
    today = _fit_synthetic(tmp_path, "today", [f"checkpoint.format={fmt}"], callbacks=[StopAtStep(7)])
    assert (today.status, today.global_step) == (RunStatus.PREEMPTED, 7)
    here_path = tmp_path / "today" / "checkpoints" / stored_path.name
    here = load_last_checkpoint(tmp_path / "today" / "checkpoints")

    upgraded = upgrade_presplit(stored_path, stored, 40)
    assert upgraded["step"] == here["step"] == 7
    assert upgraded["progress"] == here["progress"] == {"epoch": 1, "batches_done": 4, "global_step": 7,
                                                         "epoch_offset": 0}
    assert upgraded["sampler"] == here["sampler"]
    assert _same_streams(_rank_streams(stored_path), _rank_streams(here_path))
    assert stored["scheduler"] == here["scheduler"]
    for key, value in here["model"].items():  # the same run: ulps apart at most
        torch.testing.assert_close(stored["model"][key], value, rtol=1e-5, atol=1e-7)

    shutil.copytree(PRESPLIT / fmt, tmp_path / "resumed" / "checkpoints")
    caplog.set_level(logging.INFO)
    resumed = _fit_synthetic(tmp_path, "resumed", [f"checkpoint.format={fmt}"])
    resuming = [record.getMessage() for record in caplog.records if "resuming from" in record.getMessage()]
    assert len(resuming) == 1 and resuming[0].endswith(": epoch 2, batch 4, step 7"), resuming

    def stored_weights(trainer) -> None:  # today's checkpoint, with the floats the stored one holds
        trainer.state.model.load_state_dict(stored["model"])
        trainer.state.optimizer.load_state_dict(stored["optimizer"])

    shutil.copytree(tmp_path / "today" / "checkpoints", tmp_path / "reference" / "checkpoints")
    reference = _fit_synthetic(tmp_path, "reference", [f"checkpoint.format={fmt}"], before_fit=stored_weights)
    assert (resumed.status, resumed.global_step) == (reference.status, reference.global_step) == (RunStatus.COMPLETED, 10)

    a = load_last_checkpoint(tmp_path / "reference" / "checkpoints")
    b = load_last_checkpoint(tmp_path / "resumed" / "checkpoints")
    assert a["progress"] == {"epoch": 2, "batches_done": 0, "global_step": 10, "epoch_offset": 0}
    assert_same_training_state(a, b)  # dropout after the resume drew from the migrated RNG streams
    assert a["scheduler"] == b["scheduler"] and a["sampler"] == b["sampler"]
    assert a["history"][-1]["val_loss"] == b["history"][-1]["val_loss"]
    assert [row["epoch"] for row in b["history"]] == [1, 2]  # the pre-split run's epoch 1 kept
    # And both continue as the run that was never stopped: the same RNG streams at the end,
    # the same weights up to the stored ones' ulps.
    straight = _fit_synthetic(tmp_path, "straight", [f"checkpoint.format={fmt}", "checkpoint.resume=never"])
    assert (straight.status, straight.global_step) == (RunStatus.COMPLETED, 10)
    end = stored_path.name.replace("00000007", "00000010")
    assert _same_streams(_rank_streams(tmp_path / "straight" / "checkpoints" / end),
                         _rank_streams(tmp_path / "resumed" / "checkpoints" / end))
    c = load_last_checkpoint(tmp_path / "straight" / "checkpoints")
    assert c["sampler"] == b["sampler"] and c["scheduler"] == b["scheduler"]
    for key, value in c["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=1e-5, atol=1e-7)


def test_a_presplit_checkpoint_whose_data_order_cannot_be_rebuilt_is_refused_in_one_line():
    from ddp_hpc.training.checkpoint_upgrade import upgrade_presplit

    state = {"format": ckpt.FORMAT_VERSION, "progress": {"epoch": 1, "batches_done": 4, "global_step": 7},
             "world_size": 1}
    with pytest.raises(ckpt.CheckpointError, match=r"^checkpoint old\.pt was written before ddp_hpc's Trainer "
                                                    r"split and its place in the data order cannot be rebuilt "
                                                    r"\(KeyError: 'config'\)") as refused:
        upgrade_presplit(Path("old.pt"), state, 40)
    assert "\n" not in str(refused.value)
    today = {**state, "step": 7, "sampler": {}}
    assert upgrade_presplit(Path("new.pt"), today, 40) is today  # today's layout passes through


def test_inspect_says_which_tier_each_restart_in_place_resumed_from(tmp_path):
    """``ddp-hpc checkpoint inspect`` lists, after the checkpoints, one line per restart in
    place (``record/resume-<restart>.json``): the snapshots in memory or the disk."""
    from ddp_hpc.engine.checkpoint_tools import format_table, inspect_checkpoints, inspect_resumes
    from ddp_hpc.engine.recovery.record import ResumeEvent, write_resume

    (tmp_path / "checkpoints").mkdir()
    write_resume(tmp_path, ResumeEvent(restart=2, tier="disk", step=40, checkpoint_step=40))
    write_resume(tmp_path, ResumeEvent(restart=1, tier="memory", step=37, checkpoint_step=30, from_buddies=(2,)))
    assert inspect_resumes(tmp_path / "checkpoints") == inspect_resumes(tmp_path)  # the run or its checkpoints/
    shown = format_table(inspect_checkpoints(tmp_path), inspect_resumes(tmp_path)).splitlines()
    assert shown == ["no checkpoints",
                     "restart 1: resumed at step 37 from the snapshots in node-local memory, the shards of rank(s) 2 "
                     "from a buddy's copy (the newest checkpoint: step 30)",
                     "restart 2: resumed at step 40 from the checkpoint on disk"]


@pytest.mark.multiproc
def test_a_dcp_checkpoint_of_a_ddp_model_keeps_rank_0s_buffers(tmp_path):
    """DCP takes a tensor every rank holds under one name for the same everywhere and writes
    one rank's copy, spread over the ranks; a DDP model's BatchNorm statistics differ per
    rank (DDP broadcasts rank 0's at each forward): the checkpoint holds rank 0's, which
    every rank gets back."""
    from conftest import REPO, clean_env, ddp_hpc_command

    script = REPO / "tests" / "scripts" / "dcp_ddp_buffers.py"
    result = subprocess.run([*ddp_hpc_command(), "launch", "--nproc", "2", "--", "python", str(script),
                             str(tmp_path / "run")], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # Two ranks share the launch's stdout: a line may arrive cut by the other's (seen in CI).
    assert sorted(re.findall(r"restored rank (\d): (\d+\.\d+)", result.stdout)) == [("0", "1.0"), ("1", "1.0")], \
        result.stdout[-2000:]

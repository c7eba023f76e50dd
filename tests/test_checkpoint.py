"""Checkpoint files: atomic writes, safe loading, fallbacks and model matching."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from ddp_hpc.training import checkpoint as ckpt


def _state(step: int) -> dict:
    return {"format": ckpt.FORMAT_VERSION, "model": {"w": torch.full((3,), float(step))},
            "progress": {"epoch": 0, "batches_done": step, "global_step": step}}


def test_save_then_load(tmp_path):
    path = ckpt.save_atomic(_state(5), tmp_path / "step-00000005.pt")
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.full((3,), 5.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005.pt"]  # no temp file left


@pytest.mark.reliability
def test_a_crash_while_writing_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ckpt.save_atomic(_state(1), path)

    def crash(obj, handle):
        handle.write(b"PK\x03\x04half a zip")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_atomic(_state(2), path)
    monkeypatch.undo()
    assert ckpt.load_checkpoint(path)["progress"]["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


@pytest.mark.reliability
def test_truncated_newest_is_reported_and_the_previous_used(tmp_path, caplog):
    for step in (10, 20, 30):
        ckpt.save_atomic(_state(step), ckpt.step_path(tmp_path, step))
    newest = ckpt.step_path(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:100])
    path, state = ckpt.newest_loadable(tmp_path)
    assert path.name == "step-00000020.pt" and state["progress"]["global_step"] == 20
    assert "step-00000030.pt is unreadable" in caplog.text


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

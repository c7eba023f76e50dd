"""What a user writing their own loop with the engine's parts meets first (issue 32): the
parts in a single process, the messages they log, the refusals of a corrupt checkpoint."""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import ddp_hpc
from conftest import REPO, run
from ddp_hpc.engine.checkpoint import files as files


def test_the_sampler_in_a_single_process_without_a_group_deals_everything_to_rank_0():
    assert not dist.is_initialized()
    data = TensorDataset(torch.arange(10))
    sampler = ddp_hpc.ResumableSampler(data, shuffle=False, batch_size=4)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert list(sampler) == list(range(10))


def test_the_sampler_names_the_epoch_it_continues_by_sampler_epoch(caplog):
    data = TensorDataset(torch.arange(96))
    old = ddp_hpc.ResumableSampler(data, 2, 0, shuffle=True, seed=5, batch_size=4)
    old.set_epoch(1)
    old.advance(3)
    new = ddp_hpc.ResumableSampler(data, 3, 0, shuffle=True, seed=5, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="ddp_hpc.engine.sampler"):
        new.load_state_dict(old.state_dict())
    assert new.epoch == 1
    (message,) = [r.getMessage() for r in caplog.records if "continues on 3 ranks" in r.getMessage()]
    assert "epoch 1 (sampler.epoch, counted from 0) goes on after 24 of its samples" in message, message


def test_a_stop_names_what_caused_it_the_deadline_or_a_request(caplog):
    clock = [1000.0]
    by_deadline = ddp_hpc.StopAgreement(deadline=1100.0, margin_s=30.0, clock=lambda: clock[0])
    by_request = ddp_hpc.StopAgreement(deadline=None)
    with caplog.at_level(logging.WARNING, logger="ddp_hpc.engine.stop_agreement"):
        for _ in range(100):  # bounded: a deadline that is never seen fails here, not by timeout
            if by_deadline.now():
                break
            clock[0] += 10
        by_request.request()
        assert by_request.now()
    stops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopped")]
    assert stops == ["stopped ahead of the job deadline at step 8: rerun or requeue to resume",
                     "stopped on request at step 1: rerun or requeue to resume"], stops


def test_rank_0_leaves_the_stop_marker_a_batch_script_reads(tmp_path, monkeypatch):
    """Under srun --kill-on-bad-exit or torchrun, a loop's 75 reaches the rendered script as
    another status; $DDP_HPC_RUN_FOLDER/preempted (newer than the attempt) tells it the ranks
    stopped, so it requeues instead of restarting (docs/run.md). The Trainer's stop and a
    loop of one's own both go through StopAgreement.now()."""
    monkeypatch.setenv("DDP_HPC_RUN_FOLDER", str(tmp_path / "run"))
    stop = ddp_hpc.StopAgreement(deadline=None)
    assert not stop.now() and not (tmp_path / "run" / "preempted").exists()  # no stop: no marker
    stop.request()
    assert stop.now() and (tmp_path / "run" / "preempted").is_file()
    monkeypatch.delenv("DDP_HPC_RUN_FOLDER")
    assert ddp_hpc.StopAgreement(deadline=None).marker is None  # outside a rendered script: none


class _ThreadRank:
    """One of two ranks played by threads of this process: ``all_reduce`` meets the other's values."""

    def __init__(self, rank: int, meeting: threading.Barrier, values: list) -> None:
        self.rank, self.world_size, self.is_rank_zero, self.group_initialized = rank, 2, rank == 0, True
        self._meeting, self._values = meeting, values

    def barrier(self) -> None:
        self._meeting.wait(timeout=60)

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        self._values[self.rank] = list(values)
        self._meeting.wait(timeout=60)
        both = list(self._values)
        self._meeting.wait(timeout=60)  # both have read before either writes again
        return [{"sum": sum, "max": max, "min": min}[op](column) for column in zip(*both)]


def test_a_stop_requested_on_rank_1_alone_stops_both_ranks_at_the_same_step():
    """docs/api.md: stop.now() is True on every rank at the same step once *any* rank
    called stop.request(); every test before asked on rank 0 (or on all)."""
    meeting, values = threading.Barrier(2), [None, None]
    stopped_at: dict[int, int | None] = {}

    def rank(r: int) -> None:
        stop = ddp_hpc.StopAgreement(deadline=None, group=_ThreadRank(r, meeting, values))
        stopped_at[r] = None
        for step in range(1, 11):
            if r == 1 and step == 4:
                stop.request()  # as rank 1's signal handler would
            if stop.now():
                stopped_at[r] = step
                break

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert stopped_at == {0: 4, 1: 4}


# ----- refusals of a checkpoint that cannot be used ----------------------------------------

class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _corrupt(kind: str, path: Path) -> None:
    """``path`` made into a file of ``kind`` that is no usable checkpoint."""
    if kind == "folder":
        path.mkdir()
        return
    good = io.BytesIO()
    torch.save({"format": files.FORMAT_VERSION, "model": {"w": torch.randn(4000)}}, good)
    path.write_bytes({"text": b"my notes, not a checkpoint\n" * 10, "random bytes": bytes(range(7, 256)) * 40,
                      "empty": b"", "truncated": good.getvalue()[:len(good.getvalue()) // 2]}.get(kind, b""))
    if kind == "pickled code":
        torch.save({"format": files.FORMAT_VERSION, "model": _Payload()}, path)
    if kind == "zip of something else":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "hello")


REFUSALS = {
    "text": "is not a checkpoint file: its bytes are not what torch.save writes (text, or another kind of file)",
    "random bytes": "is not a checkpoint file: its bytes are not what torch.save writes (text, or another kind of "
                    "file)",
    "folder": "is a folder, not a checkpoint file",
    "empty": "is unreadable (truncated or corrupt: it is empty, 0 bytes)",
    "truncated": "is unreadable (truncated or corrupt: its end is missing, {size} bytes, as a write or a copy that "
                 "did not finish leaves it)",
    "pickled code": "holds objects other than tensors and plain data (posix.system) and is refused: checkpoints are "
                    "read weights-only, never running code from a file",
    "zip of something else": "is a zip archive, not a checkpoint torch.save wrote",
}


@pytest.mark.parametrize("kind", REFUSALS)
def test_a_file_that_is_no_usable_checkpoint_is_refused_saying_what_is_wrong_in_one_whole_line(tmp_path, kind):
    path = tmp_path / "step-00000003.pt"
    _corrupt(kind, path)
    with pytest.raises(files.CheckpointError) as refused:
        files.load_checkpoint(path)
    size = path.stat().st_size if path.is_file() else 0
    assert str(refused.value) == f"checkpoint {path} {REFUSALS[kind].format(size=size)}"


def test_checkpoint_inspect_shows_the_whole_refusal(tmp_path):
    from ddp_hpc.engine.checkpoint_tools import format_table, inspect_checkpoints
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    _corrupt("truncated", folder / "step-00000003.pt")
    (row,) = format_table(inspect_checkpoints(tmp_path)).splitlines()[1:]
    assert row.endswith("(is unreadable (truncated or corrupt: its end is missing, "
                        f"{(folder / 'step-00000003.pt').stat().st_size} bytes, as a write or a copy that did not "
                        "finish leaves it))"), row


class _Rank:
    """The group as one rank sees it (the files are the same for every rank)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size, self.is_rank_zero, self.group_initialized = rank, 2, rank == 0, False

    def barrier(self) -> None:
        pass


def _checkpointer(folder: Path, rank: int = 0, **kwargs) -> ddp_hpc.Checkpointer:
    torch.manual_seed(0)
    return ddp_hpc.Checkpointer(folder, {"model": nn.Linear(2, 1)}, group=_Rank(rank), **kwargs)


def test_a_refused_checkpoint_is_logged_by_one_rank_only(tmp_path, caplog):
    for step in (1, 2):
        checkpointer = _checkpointer(tmp_path)
        checkpointer.step = step
        checkpointer.save()
    _corrupt("text", tmp_path / "checkpoints" / "step-00000002.pt")
    for rank in (0, 1):
        assert _checkpointer(tmp_path, rank).restore() == tmp_path / "checkpoints" / "step-00000001.pt"
    refusals = [r.getMessage() for r in caplog.records if "step-00000002.pt" in r.getMessage()]
    assert len(refusals) == 1, refusals


def test_a_refused_checkpoint_neither_counts_toward_keep_last_nor_is_pruned(tmp_path):
    """keep_last=2, checkpoints at 3, 6, 9; 9 is damaged: the resume from 6 stops at 7
    and 8. Both readable ones stay each time, and the damaged one is kept for the user."""
    folder = tmp_path / "checkpoints"
    checkpointer = _checkpointer(tmp_path, every_n_steps=3, keep_last=2)
    for _ in range(9):
        checkpointer.step_done()
    _corrupt("truncated", folder / "step-00000009.pt")
    resumed = _checkpointer(tmp_path, every_n_steps=3, keep_last=2)
    assert resumed.restore() == folder / "step-00000006.pt"
    names = []
    for _ in range(2):
        resumed.step_done()
        resumed.save()
        names.append(sorted(p.name for p in files.periodic_checkpoints(folder)))
    assert names == [["step-00000006.pt", "step-00000007.pt", "step-00000009.pt"],
                     ["step-00000007.pt", "step-00000008.pt", "step-00000009.pt"]]
    resumed.step_done()  # step 9 written again, whole: an ordinary checkpoint from now on
    resumed.step_done()
    resumed.save()
    assert sorted(p.name for p in files.periodic_checkpoints(folder)) == ["step-00000009.pt", "step-00000010.pt"]


# ----- the own-loop example as one process -------------------------------------------------

EXAMPLE = REPO / "examples" / "resumable_loop.py"
# Sends this process a real SIGUSR2 while the Checkpointer is made: after the example's
# ddp_hpc.record_stop_signals(), before its stop.handle_signals().
EARLY_SIGNAL = """
import os, runpy, signal, sys
from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
real_init = Checkpointer.__init__
def init(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGUSR2)
    real_init(self, *args, **kwargs)
Checkpointer.__init__ = init
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.multiproc
def test_the_example_runs_as_one_process_stops_on_a_sigusr2_sent_before_handle_signals_and_resumes(tmp_path):
    env = {"RUN_DIR": str(tmp_path / "run")}
    stopped = run([sys.executable, "-c", EARLY_SIGNAL, str(EXAMPLE)], env=env, timeout=300)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "SIGUSR2 received before the loop could act on it" in stopped.stderr
    assert "stopped on request at step 1 with a checkpoint" in stopped.stderr
    resumed = run([sys.executable, str(EXAMPLE)], env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Rank 0's INFO line: the example configures logging, as docs/api.md says a script must.
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-00000001.pt'} (step 1)" in resumed.stderr
    assert "rank 0/1 local_rank 0: all_reduce correct=" in resumed.stdout
    assert files.load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["step"] == 5 * 47

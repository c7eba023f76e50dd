"""The public parts for a loop of one's own (ddp_hpc.engine), in one process: checkpoint
round trips, refused files, the data order across world sizes, the stop agreement.
Real launches of examples/resumable_loop.py are in test_own_loop.py."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_hpc
from conftest import REPO, run
from ddp_hpc.engine.checkpoint import files as files
from ddp_hpc.engine.checkpoint.dcp_read import sharded_checkpoints


def _setup(folder: Path, init_seed: int = 0, **kwargs):
    """``init_seed``: the seed of the initial weights, the sampler's order and dropout (the
    data are the same whatever it is). A resume under another seed ends as the run it
    resumes only if the checkpoint was restored: a silent start-over cannot pass for one."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    sampler = ddp_hpc.ResumableSampler(data, 1, 0, shuffle=True, seed=3 + init_seed, batch_size=8)
    loader = DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())
    checkpointer = ddp_hpc.Checkpointer(folder, {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                                                 "sampler": sampler}, extras={"seen": 0}, **kwargs)
    return model, optimizer, scheduler, sampler, loader, checkpointer


def _train(folder: Path, epochs: int, stop_at: int | None = None, **kwargs) -> tuple[dict, ddp_hpc.Checkpointer]:
    """Train (resuming from ``folder``) until ``epochs`` or until step ``stop_at``. The
    result's ``restored``: what ``restore`` gave back (path, step, extras, the sampler's
    place); ``trained``: the steps this call took."""
    model, optimizer, scheduler, sampler, loader, checkpointer = _setup(folder, **kwargs)
    path = checkpointer.restore()
    restored = {"path": path, "step": checkpointer.step, "extras": dict(checkpointer.extras),
                "sampler": sampler.progress(), "lr": scheduler.get_last_lr()}
    first = checkpointer.step
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()
            checkpointer.extras["seen"] += len(x)
            checkpointer.step_done()
            if checkpointer.step == stop_at:
                checkpointer.save(wait=True)
                return {}, checkpointer
    checkpointer.save(wait=True)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
            "seen": checkpointer.extras["seen"], "step": checkpointer.step, "restored": restored,
            "trained": checkpointer.step - first}, checkpointer


@pytest.mark.parametrize("fmt", ["file", "dcp"])
@pytest.mark.parametrize("background", [False, True])
def test_resume_mid_epoch_is_bit_identical_with_rng_scheduler_and_extras(tmp_path, background, fmt):
    whole, _ = _train(tmp_path / "whole", epochs=3, background=background, format=fmt)
    _train(tmp_path / "cut", epochs=3, stop_at=7, background=background, format=fmt)  # 5 batches per epoch: mid-epoch 2
    # Another seed (weights, order, dropout): only the restored state makes it end as ``whole``.
    resumed, checkpointer = _train(tmp_path / "cut", epochs=3, init_seed=1, background=background, format=fmt)
    saved = checkpointer.directory / ("step-00000007" if fmt == "dcp" else "step-00000007.pt")
    assert resumed["restored"] == {"path": saved, "step": 7, "extras": {"seen": 56},
                                   "sampler": {"epoch": 1, "batches_done": 2, "epoch_offset": 0}, "lr": [0.05]}
    assert resumed["trained"] == 8  # the 8 steps after step 7, not 15 from the start
    assert resumed["step"] == whole["step"] == 15 and resumed["seen"] == whole["seen"] == 120
    assert torch.equal(resumed["rng"], whole["rng"])  # dropout drew the same numbers
    for key, value in whole["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    for index, state in whole["optimizer"]["state"].items():
        assert torch.equal(resumed["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"])
    if fmt == "dcp":
        assert [p.name for p in sharded_checkpoints(checkpointer.directory)] == ["step-00000007", "step-00000015"]
        assert (checkpointer.directory / "last.dcp").read_text() == "step-00000015\n"
    else:
        assert [p.name for p in files.periodic_checkpoints(checkpointer.directory)] == ["step-00000007.pt",
                                                                                        "step-00000015.pt"]


def test_a_dcp_checkpoint_restores_from_each_form_a_user_names_it_by_and_the_other_format_is_refused(tmp_path):
    """``restore(path)`` with format dcp: the step folder, a file in it, ``last.dcp`` and
    ``best.dcp`` (the folder each names) all load step 7; a ``.pt`` file, a folder that is
    no checkpoint and a pointer naming nothing are refused in one line; format file refuses
    a dcp folder or pointer the same way."""
    _train(tmp_path / "run", epochs=3, stop_at=7, format="dcp")
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "best.dcp").write_text("step-00000007\n")
    folder = checkpoints / "step-00000007"
    for named in (folder, folder / ".metadata", checkpoints / "last.dcp", checkpoints / "best.dcp"):
        *_, checkpointer = _setup(tmp_path / "other", format="dcp")
        assert checkpointer.restore(named) == folder and checkpointer.step == 7, named
    (tmp_path / "stray.dcp").write_text("nothing here\n")
    (tmp_path / "x.pt").write_bytes(b"")
    for named, fragment in [(tmp_path / "x.pt", "is a single file (checkpoint.format=file), and this run reads "
                                                "format dcp: resume it with checkpoint.format=file"),
                            (tmp_path / "run", "is not a sharded checkpoint: name a step-NNNNNNNN folder, a file in "
                                               "one, or last.dcp / best.dcp"),
                            (tmp_path / "stray.dcp", "names no checkpoint folder (it should hold one line"),
                            (checkpoints / "step-00000099", "does not exist")]:
        *_, checkpointer = _setup(tmp_path / "other", format="dcp")
        with pytest.raises(ddp_hpc.UserError, match=re.escape(fragment)):
            checkpointer.restore(named)
    for named in (folder, checkpoints / "last.dcp"):
        *_, checkpointer = _setup(tmp_path / "other", format="file")
        with pytest.raises(ddp_hpc.UserError, match=re.escape("is sharded (checkpoint.format=dcp), and this run "
                                                              "reads format file: resume it with checkpoint.format=dcp")):
            checkpointer.restore(named)


def test_background_dcp_saves_refill_one_host_copy_and_each_checkpoint_holds_its_own_step(tmp_path, monkeypatch):
    """One stager serves every background save and refills the same host buffers (no
    allocation after the first save); no checkpoint holds a later step's weights, although
    the next save restages into the same memory."""
    from ddp_hpc.engine.checkpoint import dcp_format
    from ddp_hpc.engine.checkpoint.dcp_read import read_whole

    staged: list[tuple[int, int]] = []
    real_stage = dcp_format._HostStager.stage

    def stage(self, state_dict):
        copied = real_stage(self, state_dict)
        staged.append((id(self), copied["model"]["weight"].data_ptr()))
        return copied

    monkeypatch.setattr(dcp_format._HostStager, "stage", stage)
    model = nn.Linear(256, 256)
    checkpointer = ddp_hpc.Checkpointer(tmp_path, {"model": model}, every_n_steps=1, keep_last=4, background=True,
                                        format="dcp")
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.fill_(float(step))
        checkpointer.step_done()
    checkpointer.wait()
    assert len(staged) == 3 and len(set(staged)) == 1 and staged[0][1] != model.weight.data_ptr()
    for step in range(1, 4):
        saved = read_whole(tmp_path / "checkpoints" / f"step-{step:08d}")["model"]["weight"]
        assert torch.equal(saved, torch.full((256, 256), float(step))), step


def test_background_dcp_saves_of_ddp_and_fsdp2_resume_bit_identical_on_this_torch(tmp_path):
    """tests/scripts/dcp_background_resume.py on the suite's torch: one rank, two background
    saves (the second refills the first's host buffers) while training goes on, each restored
    bit-identical; FSDP2's DTensors go through the stager too. tests/test_stacks.py runs it
    on each torch of .ci/torch-versions, tests/test_gpu.py on a GPU."""
    result = run([sys.executable, str(REPO / "tests" / "scripts" / "dcp_background_resume.py"), str(tmp_path), "cpu",
                  "ddp", "fsdp2", "fsdp2:file"], timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resumed ")]
    assert resumed == [f"resumed {s} step {n}" for s in ("ddp", "fsdp2", "fsdp2:file") for n in (3, 5)], result.stdout


def test_cadence_and_keep_last(tmp_path):
    _, checkpointer = _train(tmp_path, epochs=2, every_n_steps=3, keep_last=2)
    assert [p.name for p in files.periodic_checkpoints(checkpointer.directory)] == ["step-00000009.pt",
                                                                                    "step-00000010.pt"]
    assert (checkpointer.directory / "last.pt").samefile(checkpointer.directory / "step-00000010.pt")


def test_a_step_that_ends_an_epoch_is_saved_once_at_the_epoch_end_and_the_epoch_cadence_saves(tmp_path):
    """The cadence is the Checkpointer's: ``every_n_steps`` at an epoch's last step waits for
    ``epoch_done``, which writes it once, with the epoch's end in it (the next epoch's start);
    ``every_n_epochs`` saves at every 2nd epoch end; the hook hears of each save before it."""
    written, saving = [], []
    *_, sampler, loader, checkpointer = _setup(tmp_path, every_n_steps=5, every_n_epochs=2,
                                              on_written=lambda record: written.append(record.path.name),
                                              on_saving=lambda: saving.append(checkpointer.step))
    per_epoch = len(loader)  # 40 samples, batch 8: 5 steps
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in range(per_epoch):
            ends = batch + 1 == per_epoch
            assert checkpointer.step_done(epoch_ends=ends) is None or not ends
        checkpointer.extras["validated"] = epoch + 1  # the epoch's end, in the objects before its save
        path = checkpointer.epoch_done(epoch + 1)
        assert path is not None and path.name == f"step-{5 * (epoch + 1):08d}.pt"
    assert written == ["step-00000005.pt", "step-00000010.pt", "step-00000015.pt"]  # each once
    assert saving == [5, 10, 15]
    assert files.load_checkpoint(checkpointer.directory / "step-00000005.pt")["extras"]["validated"] == 1

    *_, sampler, _, by_epochs = _setup(tmp_path / "epochs", every_n_epochs=2)
    for epoch in range(1, 5):
        by_epochs.step_done()
        assert (by_epochs.epoch_done(epoch) is not None) == (epoch % 2 == 0)
    assert by_epochs.epoch_done(5) is None and by_epochs.epoch_done(5, save=True) is not None


def test_a_stop_at_an_epochs_last_step_is_saved_at_the_epoch_end(tmp_path):
    """``StopAgreement.now`` saves through the Checkpointer's ``save_step``: at an epoch's
    last step the stop's checkpoint is the epoch end's, written once (and waited for)."""
    written = []
    *_, sampler, _, checkpointer = _setup(tmp_path, on_written=lambda record: written.append(record.path.name),
                                          background=True)
    stop = ddp_hpc.StopAgreement(checkpointer, deadline=None)
    sampler.set_epoch(0)
    checkpointer.step_done(5, epoch_ends=True)
    stop.request()
    assert stop.now(steps_left_in_epoch=0) and stop.stopped_at == 1
    assert written == [] and not checkpointer.directory.exists()
    sampler.set_epoch(1)
    assert checkpointer.epoch_done(1).name == "step-00000001.pt"
    assert written == ["step-00000001.pt"]  # on disk when epoch_done returns: the stop waits for it


def test_the_deadline_counts_an_epoch_end_the_next_interval_crosses():
    """Rank 0 measures the epoch end's work (``epoch_ended``) and, where the loop says the
    next interval crosses an epoch end, stops earlier by it."""
    def run(steps_per_epoch: int, tell: bool = True) -> int:
        clock = [1000.0]
        stop = ddp_hpc.StopAgreement(deadline=1200.0, margin_s=30.0, clock=lambda: clock[0])
        for step in range(1, 100):
            clock[0] += 10
            if stop.now(steps_left_in_epoch=(-step) % steps_per_epoch if tell else None):
                return step
            if step % steps_per_epoch == 0:
                clock[0] += 40  # validation
                stop.epoch_ended()
        raise AssertionError("never stopped")

    # Epochs of 3 steps, each end 40 s: at step 8 (t=1160) the next step ends an epoch, so
    # 10 + 40 + 30 s are needed and 40 s are left. Untold, it goes on to step 9 (t=1170, 30 s
    # left < 10 + 30 s) and the epoch end's 40 s would run past the deadline.
    assert run(steps_per_epoch=3) == 8
    assert run(steps_per_epoch=3, tell=False) == 9
    assert run(steps_per_epoch=100) == 17  # no epoch end: t=1170, 30 s left < 10 + 30 s


@pytest.mark.parametrize("started", [True, False])
def test_start_has_the_deadline_measure_the_first_step(started):
    """The Trainer calls ``start()`` as training starts: a slow first step (warm-up) then
    counts, as the next interval's prediction; unstarted, steps count from the first's end."""
    clock = [1000.0]
    stop = ddp_hpc.StopAgreement(deadline=1100.0, margin_s=30.0, clock=lambda: clock[0])
    if started:
        stop.start()
    clock[0] += 50  # the first step: 50 s left, 50 + 30 s needed to go on
    assert stop.now() is started


def test_unreadable_newest_is_refused_in_one_line_and_kept(tmp_path, caplog):
    _train(tmp_path, epochs=1, stop_at=3, every_n_steps=1)
    newest = tmp_path / "checkpoints" / "step-00000003.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    *_, checkpointer = _setup(tmp_path)
    assert checkpointer.restore() == tmp_path / "checkpoints" / "step-00000002.pt"
    assert checkpointer.step == 2 and checkpointer.extras["seen"] == 16
    assert newest.exists(), "an unreadable checkpoint is kept"
    warnings = [r.getMessage() for r in caplog.records if "step-00000003.pt" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "unreadable" in warnings[0]


def _damage(folder: Path, how: str) -> None:
    if how == "truncated shard":  # the biggest shard (the weights), cut to half its bytes
        shard = max(folder.glob("*.distcp"), key=lambda path: path.stat().st_size)
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    elif how == "corrupt .metadata":
        (folder / ".metadata").write_bytes(b"\x80\x04not a pickle at all" * 8)
    else:  # "no .metadata": the write was interrupted before its last step
        (folder / ".metadata").unlink()


# What the one line about the refused folder names (its wording is the engine's).
@pytest.mark.parametrize("how, said", [("truncated shard", "__0_0.distcp"), ("corrupt .metadata", ".metadata"),
                                       ("no .metadata", ".metadata")],
                         ids=["truncated-shard", "corrupt-metadata", "no-metadata"])
def test_an_incomplete_dcp_checkpoint_is_refused_and_the_previous_one_restored(tmp_path, caplog, how, said):
    """A dcp folder with a shard shorter than its metadata says, an unreadable ``.metadata``
    or none at all is never loaded: ``restore`` loads the one before it, and keeps it."""
    import logging

    from ddp_hpc.engine.checkpoint.dcp_read import read_whole

    _train(tmp_path, epochs=1, stop_at=3, every_n_steps=1, format="dcp")
    checkpoints = tmp_path / "checkpoints"
    _damage(checkpoints / "step-00000003", how)
    caplog.set_level(logging.INFO)
    model, *_, checkpointer = _setup(tmp_path, init_seed=1, format="dcp")
    assert checkpointer.restore() == checkpoints / "step-00000002"
    assert checkpointer.step == 2 and checkpointer.extras["seen"] == 16
    saved = read_whole(checkpoints / "step-00000002")["model"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert (checkpoints / "step-00000003").is_dir(), "a refused checkpoint is kept"
    told = [r.getMessage() for r in caplog.records if "step-00000003" in r.getMessage()]
    assert len(told) == 1 and said in told[0] and "\n" not in told[0], told


def test_a_first_dcp_checkpoint_whose_write_was_interrupted_is_a_fresh_start(tmp_path):
    """No ``.metadata`` in the only folder: nothing was ever saved whole, so ``restore``
    starts afresh (it does not refuse to start) and leaves the folder alone."""
    _train(tmp_path, epochs=1, stop_at=1, format="dcp")
    _damage(tmp_path / "checkpoints" / "step-00000001", "no .metadata")
    *_, checkpointer = _setup(tmp_path, format="dcp")
    assert checkpointer.restore() is None and checkpointer.step == 0
    assert (tmp_path / "checkpoints" / "step-00000001").is_dir()


def test_checkpoint_of_other_objects_is_refused(tmp_path):
    _train(tmp_path, epochs=1, stop_at=2)
    other = ddp_hpc.Checkpointer(tmp_path, {"net": nn.Linear(4, 1)})
    with pytest.raises(ddp_hpc.UserError, match="holds no net"):
        other.restore()


def test_sampler_reshards_the_rest_of_the_epoch_counting_every_sample_once():
    data = TensorDataset(torch.arange(96))
    old = [ddp_hpc.ResumableSampler(data, 2, rank, shuffle=True, seed=5, batch_size=4) for rank in range(2)]
    trained = []
    for sampler in old:
        sampler.set_epoch(1)
        trained += list(sampler)[:3 * 4]
        sampler.advance(3)
    new = [ddp_hpc.ResumableSampler(data, 3, rank, shuffle=True, seed=5, batch_size=4) for rank in range(3)]
    for sampler in new:
        sampler.load_state_dict(old[0].state_dict())
        assert sampler.epoch == 1
        sampler.set_epoch(1)
        trained += list(sampler)
    assert sorted(trained) == list(range(96))
    for sampler in new:  # the next epoch is whole again
        sampler.set_epoch(2)
        assert len(sampler) == 32


def test_sampler_saved_at_an_epoch_end_resumes_at_the_next_epoch():
    data = TensorDataset(torch.arange(20))
    sampler = ddp_hpc.ResumableSampler(data, 2, 0, shuffle=False, batch_size=4)
    sampler.set_epoch(0)
    sampler.advance(3)  # ceil(10 / 4) batches: the epoch is done
    restored = ddp_hpc.ResumableSampler(data, 2, 0, shuffle=False, batch_size=4)
    restored.load_state_dict(sampler.state_dict())
    assert restored.epoch == 1 and len(restored) == 10


def test_the_default_margin_lets_a_one_minute_job_train_and_grows_with_the_measured_step_and_checkpoint():
    from ddp_hpc.engine.deadline import MARGIN_FLOOR_S, DeadlinePolicy, Timings, time_needed

    # A 1-minute job with 20 s of it gone to start-up, steps of 0.5 s, no checkpoint yet: it
    # trains until the next step, the checkpoint and the floor no longer fit (a fixed 60 s
    # margin stopped it at its first step).
    clock = [1000.0]
    stop = ddp_hpc.StopAgreement(deadline=1040.0, clock=lambda: clock[0])
    steps = 0
    while True:
        clock[0] += 0.5
        steps += 1
        if stop.now():
            break
    assert steps == 60 and 1040.0 - clock[0] == MARGIN_FLOOR_S  # 10 s left < 0.5 s + 10 s

    policy = DeadlinePolicy(deadline=0.0, check_every_n_steps=4)
    slow = Timings(step_s=2.0, checkpoint_s=30.0)
    assert policy.margin(Timings(step_s=0.5)) == MARGIN_FLOOR_S
    assert policy.margin(slow) == 32.0  # the slowest step and checkpoint once more
    assert time_needed(policy, slow, 4, False) == 4 * 2.0 + 30.0 + 32.0
    assert DeadlinePolicy(0.0, 4, margin_s=5.0).margin(slow) == 5.0  # a number is kept as given
    for bad in ("soon", -1.0, True):  # refused when made, not at the first deadline check
        with pytest.raises(ValueError, match="margin_s=.* must be 'auto' or seconds >= 0"):
            ddp_hpc.StopAgreement(deadline=1040.0, margin_s=bad)


def test_stop_agreement_signal_and_deadline(tmp_path):
    clock = [1000.0]
    stop = ddp_hpc.StopAgreement(deadline=1100.0, margin_s=30.0, clock=lambda: clock[0])
    for _ in range(6):  # steps of 10 s: up to 1060, the next step and the margin (40 s) still fit
        clock[0] += 10
        assert not stop.now()
    clock[0] += 10      # 1070: 30 s left < one step (10 s) + margin (30 s)
    assert stop.now() and stop.stopped and stop.exit_status == 75

    nodeadline = ddp_hpc.StopAgreement(deadline=None, check_every_n_steps=2)
    previous = signal.getsignal(signal.SIGUSR2)
    nodeadline.handle_signals()
    try:
        signal.raise_signal(signal.SIGUSR2)
        assert nodeadline.requested and not nodeadline.stopped
        assert not nodeadline.now(), "only every 2nd step is a chance to stop"
        assert nodeadline.now() and nodeadline.exit_status == 75
    finally:
        nodeadline.restore_signals()
    assert signal.getsignal(signal.SIGUSR2) is previous


def test_stop_agreement_reads_the_deadline_the_scripts_export(monkeypatch):
    monkeypatch.setenv("DDP_HPC_DEADLINE", "5000")
    assert ddp_hpc.StopAgreement().policy.deadline == 5000.0
    monkeypatch.delenv("DDP_HPC_DEADLINE")
    assert ddp_hpc.StopAgreement().policy is None


def test_stop_saves_through_the_checkpointer(tmp_path):
    *_, checkpointer = _setup(tmp_path)
    stop = ddp_hpc.StopAgreement(checkpointer, deadline=None)
    checkpointer.step_done()
    stop.request()
    assert stop.now()
    assert files.periodic_checkpoints(checkpointer.directory)[-1].name == "step-00000001.pt"


def test_watchdog_context_manager_beats():
    with ddp_hpc.watchdog(limit_s=30) as dog:
        dog.beat()
        dog.beat()
        assert dog._step == 2 and dog._phase == "training"


def test_pruning_keeps_the_dcp_folder_best_dcp_names(tmp_path):
    """docs/training.md: ``keep_last`` complete folders are kept, and the one ``best.dcp`` names."""
    model = nn.Linear(4, 4)
    checkpointer = ddp_hpc.Checkpointer(tmp_path, {"model": model}, keep_last=1, format="dcp")
    checkpointer.step_done()
    checkpointer.save(wait=True, best=True)
    for _ in range(3):
        checkpointer.step_done()
        checkpointer.save(wait=True)
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in sharded_checkpoints(checkpoints)] == ["step-00000001", "step-00000004"]
    assert (checkpoints / "best.dcp").read_text().strip() == "step-00000001"
    restored = ddp_hpc.Checkpointer(tmp_path, {"model": nn.Linear(4, 4)}, format="dcp")
    assert restored.restore(checkpoints / "best.dcp") == checkpoints / "step-00000001" and restored.step == 1


def test_dcp_metadata_is_read_weights_only(tmp_path):
    """A ``.metadata`` whose pickle would call code is refused in one line, its code never run
    (torch's own reader would unpickle it whole)."""
    import os
    import pickle

    _train(tmp_path, epochs=1, stop_at=2, every_n_steps=1, format="dcp")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (tmp_path / "checkpoints" / "step-00000002" / ".metadata").write_bytes(pickle.dumps(Payload()))
    *_, checkpointer = _setup(tmp_path, format="dcp")
    assert checkpointer.restore() == tmp_path / "checkpoints" / "step-00000001"  # the previous one
    with pytest.raises(ddp_hpc.UserError, match="step-00000002"):
        checkpointer.restore(tmp_path / "checkpoints" / "step-00000002")
    assert not marker.exists(), "the checkpoint's metadata ran code"


def test_a_deadline_already_past_at_the_start_stops_at_the_first_agreement_step():
    clock = [1000.0]
    stop = ddp_hpc.StopAgreement(deadline=990.0, check_every_n_steps=3, clock=lambda: clock[0])
    decided = []
    for _ in range(3):
        clock[0] += 0.1
        decided.append(stop.now())
    assert decided == [False, False, True] and stop.exit_status == 75

"""Stopping to be continued, in-process: the stop-signal spec, the job's deadline and the
decision to stop ahead of it, and the re-sharding of an epoch for another world size."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from conftest import REPO, clean_env, ddp_hpc_command, run
from ddp_hpc.cli_args import Parser as _Parser
from ddp_hpc.config import load_config
from ddp_hpc.contract import ExitStatus
from ddp_hpc.startup.distributed import process_group
from ddp_hpc.errors import UserError
from ddp_hpc.schedulers.slurm.render import SLURM_DEADLINE_LINES
from ddp_hpc.stop import StopSignal, job_deadline, parse_stop_signal, stop_signal_arg
from ddp_hpc.engine.checkpoint.files import load_checkpoint
from ddp_hpc.engine.sampler import ResumableSampler
from ddp_hpc.engine.deadline import DeadlinePolicy, Timings, must_stop_now
from ddp_hpc.engine.reshard import epoch_order
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.callbacks import Callback
from ddp_hpc.training.trainer import Trainer
from stop_helpers import RecordIds, RecordingJob, StopAtStep, count_ids

pytestmark = pytest.mark.reliability


# ----- the stop signal ------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("USR1@120", StopSignal(signal.SIGUSR1, 120)),
    ("SIGUSR1@120", StopSignal(signal.SIGUSR1, 120)),
    ("usr2", StopSignal(signal.SIGUSR2, 90)),
    (" TERM@0 ", StopSignal(signal.SIGTERM, 0)),
    (f"{int(signal.SIGUSR1)}@30", StopSignal(signal.SIGUSR1, 30)),
    ("HUP@65535", StopSignal(signal.SIGHUP, 65535)),
])
def test_stop_signal_spec_is_parsed(text, expected):
    parsed = parse_stop_signal(text)
    assert parsed == expected
    assert parse_stop_signal(str(parsed)) == parsed


@pytest.mark.parametrize("text,fragment", [
    ("", "is empty"),
    ("KILL@5", "KILL cannot ask the ranks to stop"),
    ("STOP", "STOP cannot ask the ranks to stop"),
    ("SEGV@10", "SEGV cannot ask"),
    ("FOO@10", "FOO cannot ask"),
    ("B:USR1@10", "B:USR1 cannot ask"),
    ("999@10", "999 is not a signal number"),
    ("USR1@", "whole seconds"),
    ("USR1@-5", "whole seconds"),
    ("USR1@1.5", "whole seconds"),
    ("USR1@2m", "whole seconds"),
    ("USR1@70000", "over SLURM's limit of 65535 s"),
])
def test_bad_stop_signal_spec_is_one_line(text, fragment):
    with pytest.raises(UserError) as raised:
        parse_stop_signal(text)
    assert fragment in str(raised.value)
    assert "\n" not in str(raised.value)


def test_signal_flag_with_a_bad_value_is_one_line_and_exit_2(capsys):
    parser = _Parser(prog="ddp-hpc render slurm")
    parser.add_argument("--signal", type=stop_signal_arg)
    assert parser.parse_args(["--signal", "USR1@120"]).signal == StopSignal(signal.SIGUSR1, 120)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--signal", "KILL@5"])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "argument --signal: stop signal 'KILL@5': KILL cannot ask" in lines[0]


@pytest.mark.parametrize("extra,env,fragment", [
    (["checkpoint.stop_signal=USR1@soon"], {}, "checkpoint.stop_signal: stop signal 'USR1@soon'"),
    ([], {"DDP_HPC_DEADLINE": "tomorrow"}, "DDP_HPC_DEADLINE='tomorrow' is not a number of seconds"),
    ([], {"DDP_HPC_WALLTIME_S": "600"}, "DDP_HPC_WALLTIME_S is set but DDP_HPC_START_TIME is not"),
])
def test_bad_stop_settings_exit_2_with_one_line_and_write_nothing(tmp_path, extra, env, fragment):
    result = run([*ddp_hpc_command(), "train", "configs/synthetic.yaml", f"logging.run_dir={tmp_path}", *extra],
                 env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


# ----- the job's deadline ---------------------------------------------------------------------

@pytest.mark.parametrize("environ,expected", [
    ({}, None),
    ({"DDP_HPC_DEADLINE": "1795335627"}, 1795335627.0),
    ({"DDP_HPC_DEADLINE": ""}, None),  # a script's lookup that found nothing
    ({"DDP_HPC_START_TIME": "1000", "DDP_HPC_WALLTIME_S": "600"}, 1600.0),
    ({"DDP_HPC_DEADLINE": "5000", "DDP_HPC_START_TIME": "1000", "DDP_HPC_WALLTIME_S": "600"}, 5000.0),
    ({"SLURM_JOB_END_TIME": "7000"}, 7000.0),
    ({"DDP_HPC_DEADLINE": "5000", "SLURM_JOB_END_TIME": "7000"}, 5000.0),
])
def test_job_deadline_from_the_environment(environ, expected):
    assert job_deadline(environ) == expected


@pytest.mark.parametrize("environ", [{"DDP_HPC_DEADLINE": "-1"}, {"DDP_HPC_DEADLINE": "nan"},
                                     {"DDP_HPC_START_TIME": "1000"}, {"SLURM_JOB_END_TIME": "N/A"}])
def test_bad_deadline_variables_are_refused(environ):
    with pytest.raises(UserError):
        job_deadline(environ)


@pytest.mark.parametrize("squeue_says", ["2026-11-22T08:23:27", "N/A", "Unknown", ""])
def test_slurm_script_lines_export_the_end_time_or_nothing(tmp_path, squeue_says):
    """The lines a SLURM batch script runs, with squeue answering as Slurm 22.05 does."""
    fake = tmp_path / "squeue"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{squeue_says}'\n")
    fake.chmod(0o755)
    script = "\n".join([*SLURM_DEADLINE_LINES, 'printf "%s" "${DDP_HPC_DEADLINE-unset}"'])
    result = subprocess.run(["bash", "-euc", script], capture_output=True, text=True,
                            env={"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_ID": "7"})
    assert result.returncode == 0, result.stderr
    if squeue_says.startswith("2026"):
        assert float(result.stdout) == time.mktime(time.strptime(squeue_says, "%Y-%m-%dT%H:%M:%S"))
    else:
        assert result.stdout == "unset"


# ----- deciding to stop ahead of it -----------------------------------------------------------

def test_stop_when_the_next_interval_and_a_checkpoint_would_not_fit():
    policy = DeadlinePolicy(deadline=1000.0, check_every_n_steps=10, margin_s=30.0)
    timings = Timings(step_s=2.0, checkpoint_s=15.0, epoch_end_s=40.0)
    # 10 steps x 2 s + checkpoint 15 s + margin 30 s = 65 s needed.
    assert not must_stop_now(policy, 1000.0 - 65.0, timings, 10, crosses_epoch_end=False)
    assert must_stop_now(policy, 1000.0 - 64.9, timings, 10, crosses_epoch_end=False)
    # Crossing an epoch end adds its validation and checkpoint: 65 + 40 + 15 s.
    assert must_stop_now(policy, 1000.0 - 119.9, timings, 10, crosses_epoch_end=True)
    assert not must_stop_now(policy, 1000.0 - 120.0, timings, 10, crosses_epoch_end=True)


class FakeClock:
    """Every reading is one second after the previous one."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _trainer(tmp_path: Path, overrides: list[str], callbacks, job=None, ctx=None, **options) -> Trainer:
    config = load_config(None, ["job.name=stop_helpers:RecordingJob", "logging.progress=never",
                                f"logging.run_dir={tmp_path}", "logging.name=r", *overrides])
    return Trainer(job or RecordingJob(), config, ctx, RunFolder(tmp_path / "r"), callbacks, **options)


def _in_process(tmp_path: Path, overrides: list[str], callbacks, job=None) -> dict:
    with process_group(environ={}) as ctx:
        return _trainer(tmp_path, overrides, callbacks, job, ctx).fit()


def test_deadline_stop_checkpoints_at_the_last_check_that_leaves_time(tmp_path, caplog):
    # 60 samples, batch 4: 15 steps per epoch, each 1 s on the fake clock (so is an epoch end).
    clock = FakeClock(start=0.0)
    policy = DeadlinePolicy(deadline=50.0, check_every_n_steps=4, margin_s=3.0)
    with process_group(environ={}) as ctx:
        trainer = _trainer(tmp_path, ["training.epochs=10", "training.batch_size=4",
                                      "checkpoint.preemption_check_every_n_steps=4",
                                      f"checkpoint.deadline_margin_s={policy.margin_s}"], [], ctx=ctx,
                           deadline=policy.deadline, clock=clock)
        summary = trainer.fit()
    stop = trainer.stop  # the engine's StopAgreement: its policy, what it measured, where it stopped
    assert stop.policy == policy
    assert summary.preempted is True
    step = summary.global_step
    assert step == stop.stopped_at and step % 4 == 0
    left = policy.deadline - clock.now  # at the stop (its checkpoint took no fake time)
    assert left >= policy.margin_s - 1, "stopped too late: the margin is used up"
    assert left < 4 * 1.0 + 2 * stop.measured.checkpoint_s + stop.measured.epoch_end_s + policy.margin_s + 1, \
        "stopped too early"
    progress = load_checkpoint(tmp_path / "r" / "checkpoints" / "last.pt")["progress"]
    assert progress["global_step"] == step
    # The Trainer's stop line names the deadline, not a request (issue 32).
    assert re.search(rf"stopped ahead of the job deadline at epoch \d+, step {step}: checkpoint saved", caplog.text)
    assert "stopped on request" not in caplog.text


class RecordSaves(Callback):
    def __init__(self) -> None:
        self.paths: list[str] = []

    def on_checkpoint_saved(self, trainer, path) -> None:
        self.paths.append(path.name)


def test_the_trainers_step_cadence_is_the_checkpointers_and_an_epochs_last_step_is_saved_once_at_its_end(tmp_path):
    """``checkpoint.every_n_steps=5`` over epochs of 15 steps: the Checkpointer's cadence saves
    steps 5 and 10 mid-epoch; step 15 ends the epoch, and its checkpoint is the epoch end's,
    written once, with the epoch's metrics row in it."""
    saves = RecordSaves()
    summary = _in_process(tmp_path, ["training.epochs=2", "training.batch_size=4", "checkpoint.every_n_steps=5",
                                     "checkpoint.every_n_epochs=null", "checkpoint.keep_last=10"], [saves])
    assert summary.global_step == 30
    assert saves.paths == [f"step-{step:08d}.pt" for step in (5, 10, 15, 20, 25, 30)]
    at_epoch_end = load_checkpoint(tmp_path / "r" / "checkpoints" / "step-00000015.pt")
    assert len(at_epoch_end["history"]) == 1 and at_epoch_end["progress"]["epoch"] == 1


# ----- re-sharding an epoch -------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [True, False])
def test_epoch_order_is_distributed_samplers(shuffle):
    dataset = TensorDataset(torch.arange(37))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=5)
    sampler.set_epoch(3)
    assert list(sampler) == epoch_order(37, seed=5, epoch=3, shuffle=shuffle)


def _samplers(size: int, world: int) -> list[ResumableSampler]:
    dataset = TensorDataset(torch.arange(size))
    samplers = [ResumableSampler(dataset, world, rank, shuffle=True, seed=11) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(2)
    return samplers


@pytest.mark.parametrize("size,world,batch,batches,new_world", [
    (60, 2, 4, 3, 3), (60, 2, 4, 3, 1), (61, 2, 4, 5, 3), (10, 4, 1, 2, 3), (100, 3, 7, 2, 5), (33, 1, 5, 4, 2),
])
def test_the_rest_of_an_epoch_is_dealt_out_once(size, world, batch, batches, new_world):
    order = epoch_order(size, seed=11, epoch=2, shuffle=True)
    # k batches on every rank of the old world size trained a prefix of the order.
    trained = [i for s in _samplers(size, world) for i in list(s)[:batches * batch]]
    position = batches * batch * world
    assert Counter(trained) == Counter(order[:position])
    # The rest over the new world size: equal shares, each remaining sample once, plus the
    # padding DistributedSampler adds (the first few of the rest repeated).
    new = _samplers(size, new_world)
    for sampler in new:
        sampler.start_epoch_at(position)
    shares = [list(s) for s in new]
    assert len({len(share) for share in shares}) == 1 and len(new[0]) == len(shares[0])
    rest = order[position:]
    padding = len(shares[0]) * new_world - len(rest)
    assert 0 <= padding < new_world
    assert Counter(i for share in shares for i in share) == Counter(rest) + Counter(rest[:padding])
    assert not set(trained) & set(rest)


def test_a_whole_epoch_is_unchanged():
    """start_epoch_at(0) is the plain DistributedSampler (the exact-resume path)."""
    for sampler in _samplers(61, 3):
        plain = DistributedSampler(sampler.dataset, 3, sampler.rank, shuffle=True, seed=11)
        plain.set_epoch(2)
        sampler.start_epoch_at(0)
        assert list(sampler) == list(plain) and len(sampler) == len(plain)


def test_resume_with_another_batch_size_counts_every_sample_once(tmp_path):
    """In-process (one rank): a change of the per-rank batch re-shards like a change of
    world size. 60 samples, batch 4, stopped at step 5 (20 samples in); resumed with batch 6."""
    records = tmp_path / "ids"
    common = ["training.epochs=2", "checkpoint.preemption_check_every_n_steps=1", "training.lr_scaling=linear",
              "training.base_batch_size=4", "training.scheduler.name=cosine", "training.optimizer=adam"]
    first = _in_process(tmp_path, [*common, "training.batch_size=4"], [RecordIds(str(records)), StopAtStep(5)])
    assert first.preempted and first.global_step == 5
    summary = _in_process(tmp_path, [*common, "training.batch_size=6"], [RecordIds(str(records))])
    # The rest of epoch 0 (40 samples) is 7 steps of 6, then 10 steps for epoch 1.
    assert summary.global_step == 5 + 7 + 10
    counts = count_ids(records)
    assert counts[0] == Counter(range(60)) and counts[1] == Counter(range(60))
    state = load_checkpoint(tmp_path / "r" / "checkpoints" / "last.pt")
    assert state["scheduler"]["last_epoch"] == 22
    assert state["scheduler"]["base_lrs"] == [pytest.approx(1e-3 * 6 / 4)]
    assert int(state["optimizer"]["state"][0]["step"]) == 22


def test_the_configured_stop_signal_checkpoints_and_exits_75(tmp_path):
    """``checkpoint.stop_signal=USR1@60``: SIGUSR1 (whose default action would kill the
    process) asks for the agreed stop, like SIGUSR2."""
    args = [*ddp_hpc_command(), "train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=512",
            "job.params.input_dim=16", "job.params.hidden=32", "job.params.depth=2", "training.epochs=200",
            "checkpoint.stop_signal=USR1@60", "checkpoint.preemption_check_every_n_steps=3",
            "logging.progress=never", "logging.plot=false", f"logging.run_dir={tmp_path}", "logging.name=usr1"]

    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    for line in process.stderr:
        if "epoch 1/200" in line:  # training is under way
            break
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == ExitStatus.REQUEUE, err[-3000:]
    assert "received SIGUSR1: will checkpoint and stop within 3 steps" in err
    # Not an error: the stop's line says what happened and how the run goes on.
    step = int(re.search(r"^ddp-hpc: stopped at step (\d+) on request; .*: rerun or requeue to resume$", err,
                         re.MULTILINE).group(1))
    assert "ddp-hpc: error" not in err
    assert step % 3 == 0
    assert load_checkpoint(tmp_path / "usr1" / "checkpoints" / "last.pt")["progress"]["global_step"] == step


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (SigCgt in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_stop_signal_outside_training_neither_kills_the_rank_nor_fails_a_finished_run(tmp_path):
    """SIGUSR2 during start-up (here: once ``ddp-hpc train`` catches it, before torch is
    imported) stops the run at its first agreement step with a checkpoint and 75, instead of
    killing it (the signal's default action); the rerun finishes, and SIGUSR2 once it has
    printed its result (teardown) leaves its exit status 0."""
    args = [*ddp_hpc_command(), "train", str(REPO / "configs" / "synthetic.yaml"), "job.params.samples=256",
            "job.params.input_dim=16", "job.params.hidden=32", "job.params.depth=2", "training.epochs=2",
            "checkpoint.preemption_check_every_n_steps=3", "logging.progress=never",
            f"logging.run_dir={tmp_path}", "logging.name=early"]

    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    deadline = time.monotonic() + 30
    while not _catches(process.pid, signal.SIGUSR2) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGUSR2)
    _, err = process.communicate(timeout=120)
    assert process.returncode == ExitStatus.REQUEUE, err[-3000:]
    assert "received SIGUSR2 during start-up: will checkpoint and stop within 3 steps" in err
    assert load_checkpoint(tmp_path / "early" / "checkpoints" / "last.pt")["progress"]["global_step"] == 3

    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    for line in process.stdout:
        if line.startswith("done:"):  # the result is printed: training has ended
            process.send_signal(signal.SIGUSR2)
            break
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    assert "resuming from" in err

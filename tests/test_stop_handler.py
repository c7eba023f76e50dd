"""The rank's one stop-signal handler (``ddp_hpc/stop_handler.py``), in-process: a stop
signal that comes before training is a stop at the first agreed step, alike on the Trainer,
a loop of one's own and the submitit task; and nothing else on the rank side installs one."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest

import ddp_hpc
from conftest import REPO
from ddp_hpc.contract import DEADLINE_VAR, RUN_FOLDER_VAR
from ddp_hpc.stop_handler import rank_stop_handler
from ddp_hpc.training import run_on_rank

pytestmark = pytest.mark.reliability

CONFIG = REPO / "configs" / "synthetic.yaml"
SMALL = ["job.params.samples=256", "job.params.val_samples=64", "job.params.input_dim=8", "job.params.hidden=8",
         "job.params.depth=1", "training.epochs=1", "checkpoint.preemption_check_every_n_steps=3",
         "logging.progress=never", "logging.plot=false"]


@pytest.fixture
def process_left_as_found(monkeypatch, tmp_path):
    """What submitit does before a task runs: its own handler on SIGUSR2 (here one that only
    notes the call). Afterwards the signals, the ``ddp_hpc`` logger and the directory are put back."""
    for name in (RUN_FOLDER_VAR, DEADLINE_VAR, "SLURM_JOB_ID", "SLURM_PROCID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    logger = logging.getLogger("ddp_hpc")
    logger_state = (list(logger.handlers), logger.level, logger.propagate)
    submitits: list[int] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: submitits.append(signum))
    yield submitits
    rank_stop_handler().give_back()
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    for handler in [h for h in logger.handlers if h not in logger_state[0]]:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logger_state[1])
    logger.propagate = logger_state[2]


@pytest.fixture
def signal_during_set_up(monkeypatch):
    """SIGUSR2 to this process while ``train`` builds the job: after the process group
    started, before training."""
    real = run_on_rank.create_job

    def create_job(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR2)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_on_rank, "create_job", create_job)


def test_a_signal_before_training_is_a_stop_on_the_trainer(tmp_path, process_left_as_found, signal_during_set_up,
                                                           caplog):
    ddp_hpc.record_stop_signals()  # what `ddp-hpc train` does before torch is imported
    config = ddp_hpc.load_config(CONFIG, [*SMALL, f"logging.run_dir={tmp_path}", "logging.name=trainer"])
    summary = ddp_hpc.train(config, options=ddp_hpc.TrainOptions(handle_signals=True))
    assert summary.preempted and summary.exit_status == 75
    assert (summary.stopped_by, summary.global_step) == ("SIGUSR2", 3)
    assert "received SIGUSR2 during start-up: will checkpoint and stop within 3 steps" in caplog.text
    assert not process_left_as_found  # the handler before it never saw the signal


def test_a_signal_before_training_is_a_stop_in_a_loop_of_ones_own(process_left_as_found, caplog):
    term = signal.getsignal(signal.SIGTERM)
    ddp_hpc.record_stop_signals()
    os.kill(os.getpid(), signal.SIGUSR2)
    stop = ddp_hpc.StopAgreement(deadline=None, check_every_n_steps=2, marker=None)
    stop.handle_signals()
    try:
        assert stop.requested
        assert not stop.now() and stop.now() and (stop.stopped_at, stop.exit_status) == (2, 75)
    finally:
        stop.restore_signals()
    assert "SIGUSR2 received before the loop could act on it" in caplog.text
    # What handle_signals took is given back; SIGUSR2, recorded before it, stays recorded.
    assert signal.getsignal(signal.SIGTERM) == term and rank_stop_handler().signals == (signal.SIGUSR2,)
    assert not process_left_as_found


def test_a_signal_before_training_is_a_stop_in_the_submitit_task(tmp_path, monkeypatch, process_left_as_found,
                                                                 signal_during_set_up):
    """Before: the task's early SIGUSR2 reached submitit's handler, which requeues at once
    wherever the ranks are. Now the ranks stop at the first agreed step, checkpointed, and
    only then is submitit's handler (back in place) called."""
    from ddp_hpc.schedulers.slurm import in_job
    from ddp_hpc.specs.request import TrainPayload

    handed_over = []

    def hand_over(signum):
        handed_over.append((signum, signal.getsignal(signal.SIGUSR2)))
        raise SystemExit(75)

    monkeypatch.setattr(in_job, "hand_over_to_submitit", hand_over)
    submitits = process_left_as_found
    submitit_handler = signal.getsignal(signal.SIGUSR2)
    payload = TrainPayload(str(CONFIG), (*SMALL, f"logging.run_dir={tmp_path}", "logging.name=submitit"))
    with pytest.raises(SystemExit):
        in_job.SubmititTrainTask(payload, str(tmp_path))()
    assert handed_over == [(signal.SIGUSR2, submitit_handler)] and not submitits
    log = (tmp_path / "submitit" / "logs" / "rank-00000.log").read_text()
    assert "received SIGUSR2 during start-up: will checkpoint and stop within 3 steps" in log
    assert re.search(r"stopped on request at epoch 1, step 3\b", log), log


def test_the_package_installs_signal_handlers_in_one_place():
    """Rank side and launch side alike: ``signal.signal`` appears in stop_handler.py only
    (the launch's Supervisor is handed ``signal.signal`` by the CLI, which owns the process),
    and in the recovery fuzzer's ``python -m`` entry, a command that owns its process too."""
    package = REPO / "ddp_hpc"
    installers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                        if re.search(r"\bsignal\.signal\(", p.read_text()))
    assert installers == ["bench/recovery_fuzz.py", "stop_handler.py"], installers

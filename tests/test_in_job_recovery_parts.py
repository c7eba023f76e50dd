"""In-job recovery's parts that need no launch: the one-line refusals and fall-backs."""

import argparse
import logging

import pytest

from ddp_hpc.errors import UserError


def test_fsdp2_is_refused_in_one_line(tmp_path):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddp_hpc.engine.recovery import refuse_sharded

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain = nn.Sequential(nn.Linear(4, 4))
        refuse_sharded(plain)  # DDP's module: accepted
        sharded = nn.Sequential(nn.Linear(4, 4))
        fully_shard(sharded)
        with pytest.raises(UserError, match="in-job recovery covers DDP only") as refused:
            refuse_sharded(sharded)
        assert "\n" not in str(refused.value)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("launcher", ["mpich", "openmpi"])
def test_recover_under_mpiexec_says_in_one_line_that_a_failure_restarts_in_place(launcher, caplog):
    from ddp_hpc.cli import _in_job_recovery
    from ddp_hpc.launch.local import LocalLaunch, attempt_starter

    args = argparse.Namespace(recover=1, recovery_wait=120.0, shrink=False, hang_timeout=10.0, launcher=launcher,
                              warm_spare=False)
    starter = attempt_starter(LocalLaunch(nproc=2, command=["true"], launcher=launcher))
    with caplog.at_level(logging.WARNING, logger="ddp_hpc"):
        assert _in_job_recovery(args, starter) is None
    [line] = [record.getMessage() for record in caplog.records]
    assert f"in-job recovery is off under --launcher {launcher}" in line and "restarts in place" in line


def test_recover_under_the_default_launcher_recovers(caplog):
    from ddp_hpc.cli import _in_job_recovery
    from ddp_hpc.launch.local import LocalLaunch, attempt_starter
    from ddp_hpc.launch.recovering import Recoverer

    args = argparse.Namespace(recover=2, recovery_wait=60.0, shrink=True, hang_timeout=5.0, launcher="torchrun",
                              warm_spare=False)
    recoverer = _in_job_recovery(args, attempt_starter(LocalLaunch(nproc=2, command=["true"])))
    assert isinstance(recoverer, Recoverer)
    assert (recoverer.limits.max_recoveries, recoverer.limits.shrink, recoverer.limits.hang_s) == (2, True, 5.0)
    from ddp_hpc.contract import RECOVERY_SHRINK_VAR
    from ddp_hpc.engine.recovery_store import LaunchStore

    recoverer._store = LaunchStore()  # each rank hears of --shrink (the Trainer refuses it)
    assert recoverer._environment(0)[RECOVERY_SHRINK_VAR] == "1"
    assert not caplog.records


def test_a_negative_recovery_count_is_refused():
    from ddp_hpc.launch.recovering import RecoveryLimits

    with pytest.raises(UserError, match="--recover -1 must be >= 0"):
        RecoveryLimits(-1)


def test_a_warm_spare_with_shrinking_is_refused():
    from ddp_hpc.launch.recovering import RecoveryLimits

    with pytest.raises(UserError, match="--warm-spare replaces a lost rank, --shrink goes on without it"):
        RecoveryLimits(1, shrink=True, warm_spare=True)


def test_a_replacement_takes_the_lost_ranks_streams_of_the_step_before_only_where_the_step_drew_nothing():
    import torch

    from ddp_hpc.engine import recovery_store as keys
    from ddp_hpc.engine.recovery import InJobRecovery, RecoveryError, same_rng
    from ddp_hpc.engine.rng import capture_rng

    before = capture_rng()
    assert same_rng(before, capture_rng())  # nothing drawn
    torch.rand(1)
    after = capture_rng()
    assert not same_rng(before, after)

    class Store:  # the lost rank 2 completed step 6 and was lost after its all-reduce of step 7
        def get(self, key: str) -> bytes:
            return {keys.rng_key(2, 6): keys.rng_to_bytes(6, after), keys.rng_key(2, 7): keys.rng_to_bytes(5, before)}[key]

    joining = object.__new__(InJobRecovery)
    joining.slot, joining._store = 2, Store()
    assert same_rng(joining._rng_after(6, joining=True), after)  # its copy of the very step
    assert same_rng(joining._rng_after(7, joining=True, drew_nothing=True), after)
    with pytest.raises(RecoveryError, match="lost after its all-reduce"):
        joining._rng_after(7, joining=True, drew_nothing=False)

    survivor = object.__new__(InJobRecovery)
    survivor._rng = {6: before, 7: capture_rng()}
    assert not survivor._drew_nothing(7)  # torch.rand above drew between its copies
    survivor._rng = {6: after, 7: capture_rng()}
    assert survivor._drew_nothing(7) and not survivor._drew_nothing(8)


#: A rank that stops (75) on SIGUSR2. A replacement (or a warm spare) installs its handler only
#: once told to (a file), as one still importing torch has none yet: a SIGUSR2 before it would end it.
STOPPABLE_RANK = """
import os, signal, sys, time
from pathlib import Path
folder = Path(os.environ["TEST_FOLDER"])
if os.environ.get("DDP_HPC_RECOVERY_GENERATION") or os.environ.get("DDP_HPC_RECOVERY_SPARE"):
    while not (folder / "go").exists():
        time.sleep(0.02)
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(75))
(folder / f"armed-{os.getpid()}").write_text("")
time.sleep(60)
sys.exit(1)
"""


@pytest.mark.parametrize("warm_spare", [False, True], ids=["new-process", "warm-spare"])
def test_a_stop_that_comes_while_a_replacement_starts_is_held_for_it_until_it_is_up(tmp_path, warm_spare):
    """The launch's logic in this process (ranks are small Python processes, no torch): rank 1
    is killed, its replacement started (or the warm spare given its place); a stop then goes
    to rank 0 at once and to the replacement only once it has started InJobRecovery (its
    ready key), so nothing ends it and the launch ends with 75 (stopped on request)."""
    import os
    import signal
    import sys
    import threading
    import time

    from ddp_hpc.engine.recovery_store import ready_key
    from ddp_hpc.launch.recovering import Recoverer, RecoveryLimits
    from ddp_hpc.launch.restart import RestartPolicy
    from ddp_hpc.launch.supervisor import LocalRanks, Supervisor

    def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    def armed(child) -> bool:
        return (tmp_path / f"armed-{child.pid}").exists()

    ranks = LocalRanks(2, [sys.executable, "-c", STOPPABLE_RANK], base_env={**os.environ,
                                                                            "TEST_FOLDER": str(tmp_path)})
    recoverer = Recoverer(ranks, RecoveryLimits(1, hang_s=600, warm_spare=warm_spare))  # none is frozen here
    supervisor = Supervisor(recoverer.start, RestartPolicy(0), end_grace_s=5, in_job=recoverer)
    statuses: list[int] = []
    runner = threading.Thread(target=lambda: statuses.append(supervisor.run()), daemon=True)
    runner.start()
    try:
        wait_for(lambda: len(supervisor._children) == 2 and all(map(armed, supervisor._children)), "ranks up")
        first = list(supervisor._children)
        for slot in range(2):  # as InJobRecovery says it runs
            recoverer._store.store.set(ready_key(slot), "1")
        if warm_spare:
            wait_for(lambda: recoverer._spare is not None, "no spare started")
            spare = recoverer._spare
        first[1].kill()
        wait_for(lambda: supervisor._children[1] is not first[1], "no replacement started")
        replacement = supervisor._children[1]
        if warm_spare:
            assert replacement is spare

        supervisor.request_stop(signal.SIGUSR2)
        wait_for(lambda: first[0].poll() is not None, "rank 0 did not get the stop")
        assert first[0].returncode == 75
        time.sleep(0.5)
        assert replacement.poll() is None, "the stop reached the replacement before it could take it"

        (tmp_path / "go").write_text("")
        wait_for(lambda: armed(replacement), "the replacement never installed its handler")
        recoverer._store.store.set(ready_key(1), "1")
        runner.join(timeout=30)
        assert not runner.is_alive()
        assert replacement.returncode == 75 and statuses == [75]
    finally:
        for child in supervisor._children:
            if child.poll() is None:
                child.kill()
                child.wait()


class NotPlain:
    """An object that torch.load(weights_only=True) refuses to build."""


def test_the_state_travels_as_bytes_read_back_weights_only():
    """What a survivor sends (torch.save into a uint8 tensor) comes back equal on the
    receiver, read with weights_only=True: an object that is not tensors and plain data is
    refused in one line instead of being unpickled."""
    import torch

    from ddp_hpc import ResumableSampler
    from ddp_hpc.engine.recovery import RecoveryError, state_from_tensor, state_to_tensor

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    sampler = ResumableSampler(torch.utils.data.TensorDataset(torch.arange(10)), num_replicas=2, rank=0,
                               batch_size=2)
    sampler.advance()
    state = {"step": 3, "objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "sampler": sampler.state_dict()},
             "checkpointer": {"step": 3, "saved_step": None, "saved_path": None, "extras": {"best": 0.5}}}
    payload = state_to_tensor(state)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    received = state_from_tensor(payload.clone())
    assert received["step"] == 3 and received["checkpointer"] == state["checkpointer"]
    assert received["objects"]["sampler"] == sampler.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(received["objects"]["model"][key], value)
    assert torch.equal(received["objects"]["optimizer"]["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])

    with pytest.raises(RecoveryError, match=r"NotPlain.*weights_only=True") as refused:
        state_from_tensor(state_to_tensor({**state, "extras": NotPlain()}))
    assert "\n" not in str(refused.value)


#: The Trainer, small: configs/synthetic.yaml with a few hundred samples.
SMALL_TRAINER = ["job.params.samples=256", "job.params.val_samples=0", "job.params.input_dim=16",
                 "job.params.hidden=32", "job.params.depth=2", "training.batch_size=16", "training.epochs=1",
                 "logging.progress=never", "logging.plot=false"]


@pytest.mark.parametrize("override, why", [
    ("training.strategy=fsdp2", "in-job recovery \\(--recover\\).*under fsdp2 each rank holds one shard of the model"),
    ("training.zero_optimizer=true", "in-job recovery \\(--recover\\).*each rank holds one shard of the optimizer state"),
    ("shrink", "the Trainer does not yet go on with fewer ranks under --recover --shrink"),
])
def test_the_trainer_refuses_in_job_recovery_where_it_cannot_go_on(monkeypatch, tmp_path, override, why):
    """Under `ddp-hpc launch --recover` (its store's address in the environment) the Trainer
    refuses, in one line, before it starts a group or makes its run folder: fsdp2 and ZeRO
    (a survivor lacks the lost rank's shard) and --shrink (not re-planned for fewer ranks yet)."""
    import ddp_hpc
    from ddp_hpc.config_loader import ConfigError
    from ddp_hpc.contract import RECOVERY_SHRINK_VAR, RECOVERY_STORE_VAR, RECOVERY_WAIT_VAR
    from conftest import REPO

    monkeypatch.setenv(RECOVERY_STORE_VAR, "127.0.0.1:1")  # nothing listens: a group would not form
    monkeypatch.setenv(RECOVERY_WAIT_VAR, "1")
    if override == "shrink":
        monkeypatch.setenv(RECOVERY_SHRINK_VAR, "1")
    overrides = [*SMALL_TRAINER, f"logging.run_dir={tmp_path}", *([override] if override != "shrink" else [])]
    with pytest.raises(ConfigError, match=why) as refused:
        ddp_hpc.train(REPO / "configs" / "synthetic.yaml", overrides)
    assert "\n" not in str(refused.value)
    assert not any(tmp_path.iterdir())


def test_the_trainer_under_a_recovering_launch_trains_through_in_job_recovery(monkeypatch, tmp_path):
    """One rank under a recovering launch's store (served here): the Trainer's group is
    InJobRecovery's and each step is counted through it (the rank's RNG streams after its
    last step are in the store, for a replacement); at the end it leaves the store (its
    ready key gone: the launch no longer watches it)."""
    import ddp_hpc
    from ddp_hpc.contract import RECOVERY_STORE_VAR
    from ddp_hpc.engine import recovery_store as keys
    from conftest import REPO

    store = keys.LaunchStore()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.store.port),
                        RECOVERY_STORE_VAR: store.address}.items():
        monkeypatch.setenv(name, value)
    summary = ddp_hpc.train(REPO / "configs" / "synthetic.yaml", [*SMALL_TRAINER, f"logging.run_dir={tmp_path}"])
    assert summary.status.value == "completed" and summary.global_step == 16
    assert keys.rng_from_bytes(store.store.get(keys.rng_key(0, 16)))[0] == 16
    assert not store.ready(0)

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

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

    args = argparse.Namespace(recover=1, recovery_wait=120.0, shrink=False, hang_timeout=10.0, launcher=launcher)
    starter = attempt_starter(LocalLaunch(nproc=2, command=["true"], launcher=launcher))
    with caplog.at_level(logging.WARNING, logger="ddp_hpc"):
        assert _in_job_recovery(args, starter) is None
    [line] = [record.getMessage() for record in caplog.records]
    assert f"in-job recovery is off under --launcher {launcher}" in line and "restarts in place" in line


def test_recover_under_the_default_launcher_recovers(caplog):
    from ddp_hpc.cli import _in_job_recovery
    from ddp_hpc.launch.local import LocalLaunch, attempt_starter
    from ddp_hpc.launch.recovering import Recoverer

    args = argparse.Namespace(recover=2, recovery_wait=60.0, shrink=True, hang_timeout=5.0, launcher="torchrun")
    recoverer = _in_job_recovery(args, attempt_starter(LocalLaunch(nproc=2, command=["true"])))
    assert isinstance(recoverer, Recoverer)
    assert (recoverer.limits.max_recoveries, recoverer.limits.shrink, recoverer.limits.hang_s) == (2, True, 5.0)
    assert not caplog.records


def test_a_negative_recovery_count_is_refused():
    from ddp_hpc.launch.recovering import RecoveryLimits

    with pytest.raises(UserError, match="--recover -1 must be >= 0"):
        RecoveryLimits(-1)

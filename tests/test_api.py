"""The public Python API: a flat, lazily imported set of names that does what the CLI does."""

from __future__ import annotations

import importlib
import logging
import signal
import subprocess
import sys

import pytest

import ddp_hpc
from conftest import REPO


def test_import_is_cheap_and_every_public_name_resolves():
    probe = "import sys, ddp_hpc; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    for name in ddp_hpc.__all__:
        assert getattr(ddp_hpc, name) is not None, name
    with pytest.raises(AttributeError):
        ddp_hpc.no_such_name  # noqa: B018


def test_train_from_a_config_object_leaves_the_host_process_alone(tmp_path):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    logger = logging.getLogger("ddp_hpc")
    handlers_before = list(logger.handlers)
    config = ddp_hpc.load_config(REPO / "configs" / "digits.yaml").with_overrides(
        ["training.epochs=1", f"logging.run_dir={tmp_path}", "logging.progress=never", "logging.plot=false"])
    summary = ddp_hpc.train(config)
    assert isinstance(summary, ddp_hpc.RunSummary) and summary.status.value == "completed"
    assert summary.epochs_completed == 1 and summary.world_size == 1
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # no handler left behind or installed
    assert logger.handlers == handlers_before  # the caller's logging is untouched
    assert ddp_hpc.RunSummary.read(tmp_path / "run" / "summary.json") == summary  # no file name: "run"


def test_run_summary_round_trips_and_reads_older_files():
    from ddp_hpc.summary import RunStatus

    summary = ddp_hpc.RunSummary(status=RunStatus.EARLY_STOPPED, run_dir="r", job="digits", epochs_completed=3, global_step=30, world_size=2,
                                 test={"accuracy": 0.9})
    data = summary.to_dict()
    assert data["status"] == "early_stopped" and data["stopped_early"] is True and data["schema_version"] == 1
    assert ddp_hpc.RunSummary.from_dict(data) == summary
    legacy = {"run_dir": "r", "job": "digits", "epochs_completed": 1, "global_step": 2, "world_size": 1,
              "stopped_early": False}
    assert ddp_hpc.RunSummary.from_dict(legacy).status.value == "completed"


def test_process_group_and_resolve_env_on_one_process():
    env = ddp_hpc.resolve_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")
    with ddp_hpc.process_group(device="cpu", environ={}) as ctx:
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend) == (0, 1, 0, "gloo")
        assert ctx.all_reduce([1.0, 2.0]) == [1.0, 2.0]
        assert str(ctx.torch_device) == "cpu"


def test_submit_request_build_and_dry_run_from_python(tmp_path):
    from ddp_hpc.schedulers import dry_run

    request = ddp_hpc.SubmitRequest.build("polaris", 2, command=["python", "train.py"], account="PROJ")
    plan = dry_run(request, workdir=tmp_path)
    assert plan.scheduler == "pbs" and plan.rank_argv == ("ddp-hpc", "run", "--", "python", "train.py")
    assert "#PBS -A PROJ" in plan.script and plan.submit_argv[0] == "qsub"
    with pytest.raises(ddp_hpc.UserError, match="a config or a command"):
        ddp_hpc.SubmitRequest.build("polaris", 2)
    # The name it had before: still answered, with a warning that names the new one.
    with pytest.warns(DeprecationWarning, match="ddp_hpc.JobRequest is now ddp_hpc.SubmitRequest"):
        assert ddp_hpc.JobRequest is ddp_hpc.SubmitRequest
    assert "JobRequest" not in ddp_hpc.__all__


def test_old_module_paths_still_answer_with_a_warning_naming_the_new_one_and_nothing_inside_uses_them():
    for old, new in ddp_hpc._MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: import {new} instead"):
            shim = importlib.import_module(old)
        public = [n for n in vars(importlib.import_module(new)) if not n.startswith("__")]
        assert public and all(getattr(shim, n) is getattr(importlib.import_module(new), n) for n in public)
    # The package, the CLI and the scheduler side import only the new paths (without torch: cheap).
    probe = ("import ddp_hpc, ddp_hpc.cli, ddp_hpc.schedulers, ddp_hpc.schedulers.commands, ddp_hpc.launch.hosts, "
             "ddp_hpc.launch.local, ddp_hpc.launch.recovering")
    subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", probe], check=True)

"""A launcher added from outside the package (issue 46): tests/data/site_launcher is a site's
package (a fake Flux) whose entry points register a ``Launcher`` (``ddp_hpc.launchers``) and the
rank side's ``ClusterEnvironment`` (``ddp_hpc.environments``). On ``PYTHONPATH`` it is a
``--launcher`` choice, dry-runs and runs real ranks, with no file of ddp_hpc edited."""

from __future__ import annotations

import logging
import re
import textwrap
from pathlib import Path

import pytest

from conftest import ddp_hpc_command, run
from ddp_hpc.environment.launchers import site_launchers
from ddp_hpc.errors import UserError
from ddp_hpc.launch import registry

SITE = Path(__file__).parent / "data" / "site_launcher"
BUILT_IN = ("local", "openmpi", "mpich", "pals", "srun")


@pytest.fixture
def site_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(SITE))
    registry.launchers.cache_clear()
    site_launchers.cache_clear()
    yield
    registry.launchers.cache_clear()
    site_launchers.cache_clear()


def test_the_built_ins_come_from_entry_points_and_old_names_still_work(caplog):
    from importlib.metadata import entry_points

    declared = {point.name: point.value for point in entry_points(group=registry.GROUP) if registry._own(point)}
    assert declared == {name: f"{type(registry.get(name)).__module__}:{type(registry.get(name)).__name__}"
                        for name in BUILT_IN}
    assert registry.names()[:len(BUILT_IN)] == BUILT_IN and "flux" not in registry.names()
    assert registry.hostfile_launchers() == ("openmpi", "mpich", "pals")
    with caplog.at_level(logging.WARNING):
        assert registry.get("torchrun") is registry.get("local")
    assert "--launcher torchrun is now called --launcher local" in caplog.text
    with pytest.raises(UserError, match=r"unknown launcher 'flux': choose one of local, openmpi, mpich, pals, srun$"):
        registry.get("flux")


def test_a_site_launcher_is_listed_after_the_built_ins_and_its_ranks_resolve(site_on_path):
    from ddp_hpc.cli import build_parser
    from ddp_hpc.environment import resolve_env
    from ddp_hpc.launch.spec import LaunchSpec

    assert registry.names() == (*BUILT_IN, "flux", "torchrun")
    args = build_parser().parse_args(["launch", "--launcher", "flux", "--", "true"])
    spec = LaunchSpec(tuple(args.command[1:]), launcher=args.launcher)
    assert spec.launcher.name == "flux" and spec.launcher is registry.get("flux")
    # One of its tasks, as the fake launcher starts it: no torchrun variable, Flux's only.
    task = spec.launcher.ranks(spec).environment(1, 0, 29511, "f1")
    assert "RANK" not in task and task["FLUX_TASK_RANK"] == "1"
    resolved = resolve_env(task)
    assert (resolved.source, resolved.rank, resolved.world_size, resolved.local_rank) == ("flux", 1, 2, 1)


def _site_env() -> dict[str, str]:
    return {"PYTHONPATH": str(SITE)}


def test_a_site_launcher_dry_runs(tmp_path):
    result = run([*ddp_hpc_command(), "launch", "--launcher", "flux", "--dry-run", "--", "python", "train.py"],
                 env=_site_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# at most 0 restart(s) after a failure, none after a stop (75)\n"
                                    "# flux run: 2 tasks, each with Flux's variables"), result.stdout
    assert result.stdout.rstrip().endswith("-m ddp_hpc run -- python train.py")
    # Without the site's package the name is refused as any unknown launcher.
    refused = run([*ddp_hpc_command(), "launch", "--launcher", "flux", "--dry-run", "--", "true"], cwd=tmp_path)
    assert refused.returncode == 2 and "argument --launcher: invalid choice: 'flux'" in refused.stderr


@pytest.mark.multiproc
def test_a_site_launcher_runs_two_ranks_that_meet(tmp_path):
    script = tmp_path / "meet.py"
    script.write_text(textwrap.dedent("""\
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        print(f"task {os.environ['FLUX_TASK_RANK']} rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "
              f"sum {total.item():g}", flush=True)
        dist.destroy_process_group()
    """))
    result = run([*ddp_hpc_command(), "launch", "--launcher", "flux", "--", "python", str(script)],
                 env=_site_env(), cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    # Each rank's RANK came from its Flux task variables (ddp-hpc run, through FluxEnvironment).
    lines = sorted(re.findall(r"task \d rank \d of \d sum \d+", result.stdout))
    assert lines == ["task 0 rank 0 of 2 sum 3", "task 1 rank 1 of 2 sum 3"], result.stdout + result.stderr

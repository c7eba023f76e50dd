"""Environment staging: a relocatable archive, one copy per node over a tree, and the ranks
of a rendered job running from the node-local copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO, ddp_hpc_command, run
from ddp_hpc.staging import NodeSlot, StageError, pack_environment, stage_on_node
from ddp_hpc.staging.pack import MANIFEST_NAME


def fake_venv(root: Path) -> Path:
    """A venv on the base interpreter with one module and one console script in bin/."""
    prefix = root / "shared-env"
    site = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site.mkdir(parents=True)
    (prefix / "bin").mkdir()
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (prefix / "bin" / "python").symlink_to(base)
    (prefix / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n")
    (site / "stagedmod.py").write_text("VALUE = 42\n")
    tool = prefix / "bin" / "where-is-stagedmod"
    tool.write_text(f"#!{prefix}/bin/python\nimport stagedmod, sys\nprint(stagedmod.__file__, sys.prefix)\n")
    tool.chmod(0o755)
    (prefix / "lib64").symlink_to(prefix / "lib")  # an absolute link into the prefix, as venv makes it
    return prefix


def test_a_packed_venv_runs_from_anywhere_and_is_packed_again_only_when_changed(tmp_path):
    prefix = fake_venv(tmp_path)
    archive = tmp_path / "cache" / "env.tar"
    first = pack_environment(prefix, archive)
    assert first.written and first.kind == "venv"
    assert not pack_environment(prefix, archive).written  # unchanged: reused

    copy = stage_on_node(archive, tmp_path / "node-local", tmp_path / "rdzv", NodeSlot(0, 1, "n1"))
    assert copy.path == tmp_path / "node-local" / "n1" and (copy.path / MANIFEST_NAME).is_file()
    # The console script finds the copy's interpreter, which finds the copy's site-packages.
    out = subprocess.run([str(copy.path / "bin" / "where-is-stagedmod")], capture_output=True, text=True, check=True)
    module_file, staged_prefix = out.stdout.split()
    assert Path(module_file).is_relative_to(copy.path) and Path(staged_prefix) == copy.path
    assert os.readlink(copy.path / "lib64") == "lib"
    assert not list((tmp_path / "node-local").glob(".*"))  # no temporary left behind

    site = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    (prefix / site / "new.py").write_text("")
    assert pack_environment(prefix, archive).written

    # A requeued job (same id, so the same node-local folder) replaces the copy it finds with
    # a fresh one (docs/staging.md): what the old copy held alone is gone, the new module is there.
    (copy.path / site / "left-by-the-first-attempt.py").write_text("")
    again = stage_on_node(archive, tmp_path / "node-local", tmp_path / "rdzv", NodeSlot(0, 1, "n1"))
    assert again.path == copy.path and (again.path / site / "new.py").is_file()
    assert not (again.path / site / "left-by-the-first-attempt.py").exists()
    assert not list((tmp_path / "node-local").glob(".*"))


def test_five_nodes_get_one_copy_each_over_a_binary_tree(tmp_path):
    archive = pack_environment(fake_venv(tmp_path), tmp_path / "env.tar").archive
    copies, errors = {}, []

    def node(index: int) -> None:
        try:
            copies[index] = stage_on_node(archive, tmp_path / "local", tmp_path / "rdzv",
                                          NodeSlot(index, 5, f"n{index}"), timeout_s=60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    (tmp_path / "rdzv").mkdir()
    threads = [threading.Thread(target=node, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    # Only node 0 reads the shared archive; every other node gets it from its parent.
    assert [copies[i].source for i in range(5)] == [str(archive), "node 0", "node 0", "node 1", "node 1"]
    for i in range(5):
        assert (tmp_path / "local" / f"n{i}" / "lib64").is_symlink()
        assert (copies[i].path / MANIFEST_NAME).read_bytes() == (copies[0].path / MANIFEST_NAME).read_bytes()


def test_a_node_whose_parent_never_comes_names_it(tmp_path):
    (tmp_path / "rdzv").mkdir()
    with pytest.raises(StageError, match=r"node 2 \(n3\) got nothing from its parent, node 0"):
        stage_on_node(tmp_path / "absent.tar", tmp_path / "local", tmp_path / "rdzv", NodeSlot(2, 3, "n3"),
                      timeout_s=1)


@pytest.mark.multiproc
@pytest.mark.slurm
@pytest.mark.slow  # packs and copies the whole test venv (1.6 GB, 40,000 files) twice
@pytest.mark.acceptance
def test_sbatch_stage_env_runs_every_rank_from_its_node_local_copy(tmp_path, slurm_cluster):
    """Two nodes, two ranks each: torch comes from each node's copy; each node times the import."""
    probe = tmp_path / "where_is_torch.py"
    probe.write_text("import os, time\nt = time.perf_counter()\nimport torch\n"
                     "print(f\"rank {os.environ['RANK']} node {os.environ['SLURMD_NODENAME']} torch \"\n"
                     "      f\"{torch.__file__} import {time.perf_counter() - t:.2f} s\", flush=True)\n")
    local = tmp_path / "node-local"
    try:
        _submit_and_check(tmp_path, probe, local)
    finally:  # 1.6 GB per copy and the archive: rebuilt by the next run
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def _submit_and_check(tmp_path: Path, probe: Path, local: Path) -> None:
    result = run([*ddp_hpc_command(), "submit", "slurm", "--sbatch", "--nodes", "2", "--tasks-per-node", "2",
                  "--walltime", "10", "--stage-env", "--stage-dir", str(local), "--run-dir", str(tmp_path / "runs"),
                  "--env", "DDP_HPC_STAGE_TIME_IMPORT=torch", "--wait", "--", "python", str(probe)],
                 cwd=tmp_path, timeout=600, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = next((tmp_path / "logs").glob("where_is_torch-*.out")).read_text()
    [job_root] = local.glob("ddp_hpc-env-*")
    ranks = [line.split() for line in log.splitlines() if line.startswith("rank ")]
    assert sorted(r[1] for r in ranks) == ["0", "1", "2", "3"], log
    for _, rank, _, node, _, torch_file, *_ in ranks:
        assert Path(torch_file).is_relative_to(job_root / node), (rank, torch_file)
    assert {r[3] for r in ranks} == {"n1", "n2"}
    for node in ("n1", "n2"):  # each node's copy, and the shared and staged import times side by side
        [timing] = [line for line in log.splitlines() if line.startswith(f"ddp_hpc: stage: node {node}: import torch")]
        assert "from the shared copy" in timing and f"{job_root / node}" in timing
        print(timing)
    assert len([line for line in log.splitlines() if "ddp_hpc: stage: node " in line and " MB in " in line]) == 2

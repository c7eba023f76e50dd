"""The contract module: one home for the shared names, the exit statuses and the atomic write."""

from __future__ import annotations

import ast
import functools
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env
from ddp_hpc import contract
from ddp_hpc.contract import ExitStatus, atomic_write

PACKAGE = REPO / "ddp_hpc"
CONTRACT = PACKAGE / "contract"


@functools.cache
def _modules() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module of the package but the contract, parsed once for the scans below."""
    return tuple((p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py")) if CONTRACT not in p.parents)


def test_atomic_write_takes_bytes_text_and_a_writer(tmp_path):
    path = tmp_path / "file"
    atomic_write(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    atomic_write(path, "text é")
    assert path.read_text(encoding="utf-8") == "text é"
    atomic_write(path, lambda handle: handle.write(b"from a writer"), durable=False)
    assert path.read_bytes() == b"from a writer"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, failure):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def half_then_fail(handle):
        handle.write(b"half of the new")
        raise failure

    with pytest.raises(type(failure)):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_durable_fsyncs_the_file_and_its_folder_and_not_durable_neither(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        synced.append("folder" if os.path.isdir(target) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    atomic_write(tmp_path / "a", b"x", durable=True)
    assert synced == ["file", "folder"]
    synced.clear()
    atomic_write(tmp_path / "b", b"x", durable=False)
    assert synced == []


def test_the_new_file_gets_the_mode_open_would_give(tmp_path):
    old_umask = os.umask(0o027)
    try:
        atomic_write(tmp_path / "f", b"x")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o640


def test_exit_statuses():
    assert (ExitStatus.OK, ExitStatus.FAILED, ExitStatus.USAGE, ExitStatus.WATCHDOG, ExitStatus.REQUEUE,
            ExitStatus.SIGTERM) == (0, 1, 2, 3, 75, 143)
    assert ExitStatus.of_returncode(-15) == ExitStatus.SIGTERM
    assert ExitStatus.of_returncode(75) == ExitStatus.REQUEUE


def test_contract_imports_nothing_but_the_standard_library():
    code = ("import sys, ddp_hpc.contract; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('ddp_hpc.', 'yaml'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env())
    assert result.returncode == 0, result.stderr
    # ddp_hpc.version: the package's top reads its version there (a string, nothing imported).
    assert result.stdout.strip() == ("['ddp_hpc.contract', 'ddp_hpc.contract.atomic', 'ddp_hpc.contract.exit_status', "
                                     "'ddp_hpc.contract.run_files', 'ddp_hpc.contract.submission', 'ddp_hpc.contract.variables', "
                                     "'ddp_hpc.version']")


def _string_constants(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node
        elif isinstance(node, ast.JoinedStr):
            yield from (v for v in node.values if isinstance(v, ast.Constant))


def test_every_shared_variable_name_is_defined_only_in_the_contract():
    """No other module spells a ``DDP_HPC_*`` name in code (docstrings and comments may)."""
    found = []
    for path, tree in _modules():
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in _string_constants(tree):
            if id(node) not in docstrings and "DDP_HPC_" in node.value:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert found == []
    names = [v for k, v in vars(contract).items() if k.endswith("_VAR") or k == "SWEEP_VAR_PREFIX"]
    assert len(names) == len(set(names)) and all(n.startswith("DDP_HPC_") for n in names)


def test_no_bare_requeue_or_sigterm_status_outside_the_contract():
    found = [f"{path.relative_to(REPO)}:{node.lineno}"
             for path, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and type(node.value) is int and node.value in (75, 143)]
    assert found == []


def test_every_status_the_package_exits_with_is_named_in_the_contract():
    """``os._exit``, ``sys.exit`` and ``SystemExit`` get an ``ExitStatus`` (or a status handed
    on), never a number of their own, not even through a module constant (the watchdog's 3
    was one). ``run/script_runner.py`` is the exception: a file run by path, standard library
    only, that never imports the package."""
    exits = {"_exit", "exit", "SystemExit"}

    def numbers(tree: ast.Module) -> dict[str, int]:
        return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)
                and isinstance(node.value, ast.Constant) and type(node.value.value) is int}

    found = []
    for path, tree in _modules():
        if path.name == "script_runner.py":
            continue
        constants = numbers(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args and
                    (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in exits):
                continue
            arg = node.args[0]
            value = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", None))
            if type(value) is int and value != 0:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {value}")
    assert found == []


def test_files_are_replaced_only_through_atomic_write():
    """``os.replace`` appears in the contract, in ``link_atomic`` (a rename of a hard link,
    no bytes written) where a dcp checkpoint folder of the same step is moved aside, and where a
    staged environment's unpacked folder is renamed into place (folders, no bytes written),
    nowhere else."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("replace", "rename") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(str(path.relative_to(REPO)))
    assert sorted(found) == ["ddp_hpc/engine/checkpoint/dcp_format.py", "ddp_hpc/engine/checkpoint/files.py",
                             "ddp_hpc/staging/fanout.py"]


def test_a_stop_on_request_is_a_status_not_an_error():
    from ddp_hpc.summary import RunStatus, RunSummary

    stopped = RunSummary(RunStatus.PREEMPTED, run_dir="runs/x", job="synthetic", epochs_completed=1,
                         global_step=40, world_size=2)
    assert stopped.exit_status is ExitStatus.REQUEUE
    assert stopped.stop_line() == ("stopped at step 40 on request; the checkpoint is in runs/x/checkpoints: "
                                   "rerun or requeue to resume")
    for status in (RunStatus.COMPLETED, RunStatus.EARLY_STOPPED):
        assert RunSummary(status, "runs/x", "synthetic", 1, 40, 2).exit_status is ExitStatus.OK

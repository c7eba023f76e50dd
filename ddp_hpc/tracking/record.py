"""The run record: what ran, where and with what, written once per (re)start.

``record/<UTC time>.json`` in the run folder: the command line, the resolved config, the
rendered job script, every rank's resolved environment, the hosts, versions, installed
packages and the git state of the working directory. Variables whose names mark a secret
are never written.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ddp_hpc.contract import RECORD_DIR, atomic_write

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
SCHEMA_VERSION = 1
_TIMEOUT_S = 5.0


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items()) if not SECRET_NAME.search(k)}


def rank_facts(ctx_env: dict[str, Any], device: str, backend: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """One rank's part: what ``ddp-hpc env --json`` shows, plus its process and variables."""
    return {**ctx_env, "host": socket.gethostname(), "pid": os.getpid(), "device": device,
            "backend": backend, "python": sys.executable, "environment": without_secrets(environ)}


def _first_line(argv: Sequence[str], cwd: Path | None = None) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=cwd,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (result.stdout or result.stderr).strip()
    return text.splitlines()[0] if result.returncode == 0 and text else None


def versions() -> dict[str, str | None]:
    import torch

    import ddp_hpc

    tools = {"mpi": ["mpiexec", "--version"], "slurm": ["sinfo", "--version"], "pbs": ["qstat", "--version"]}
    with ThreadPoolExecutor(len(tools)) as pool:  # at the start of every run: in parallel
        lines = dict(zip(tools, pool.map(_first_line, tools.values())))
    return {"python": platform.python_version(), "torch": torch.__version__, "ddp_hpc": ddp_hpc.__version__,
            **lines}


def packages() -> list[str]:
    """``pip freeze``, read from the installed distributions (no subprocess)."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower()] = f"{name}=={dist.version}"
    return [found[k] for k in sorted(found)]


def git_state(cwd: Path) -> dict[str, Any] | None:
    commit = _first_line(["git", "rev-parse", "HEAD"], cwd)
    if commit is None:
        return None
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL)
        dirty: bool | None = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return {"commit": commit, "dirty": dirty, "directory": str(cwd)}


def job_scripts(run_path: Path) -> dict[str, str]:
    """The batch scripts that ``ddp-hpc submit`` rendered into the run folder."""
    scripts = {}
    for path in sorted(run_path.glob("job.*")):
        if path.is_file() and path.suffix in (".pbs", ".sbatch", ".sh"):
            try:
                scripts[path.name] = path.read_text()
            except (OSError, UnicodeDecodeError):
                continue
    return scripts


def build_record(*, run_path: Path, argv: Sequence[str], config: dict[str, Any],
                 ranks: Sequence[dict[str, Any]], start_step: int, cwd: Path) -> dict[str, Any]:
    """The record, from every rank's facts (rank 0's list from an all-gather)."""
    base = ranks[0]["environment"] if ranks else {}
    rank_rows, differences = [], {}
    for facts in ranks:
        env = facts["environment"]
        diff = {k: env.get(k) for k in sorted(set(env) | set(base)) if env.get(k) != base.get(k)}
        if diff:
            differences[str(facts["rank"])] = diff
        rank_rows.append({k: v for k, v in facts.items() if k != "environment"})
    return {
        "schema_version": SCHEMA_VERSION,
        "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "start_step": start_step,
        "command_line": list(argv),
        "working_directory": str(cwd),
        "config": config,
        "job_scripts": job_scripts(run_path),
        "hosts": sorted({row["host"] for row in rank_rows}),
        "ranks": rank_rows,
        # Rank 0's variables; other ranks' only where they differ (null: not set there).
        "environment": base,
        "environment_differences": differences,
        "versions": versions(),
        "packages": packages(),
        "git": git_state(cwd),
    }


def write_record(run_path: Path, record: dict[str, Any]) -> Path:
    folder = run_path / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    path = folder / f"{stamp}-step{record['start_step']}.json"
    atomic_write(path, json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
    return path

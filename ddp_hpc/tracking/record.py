"""The run record: what ran, where and with what, written once per (re)start.

``record/<UTC time>.json`` in the run folder: the command line, the resolved config, the
rendered job script, every rank's resolved environment, the hosts, versions, installed
packages and the git state of the working directory. Variables whose names mark a secret
are never written.

Up to ``MAX_GATHERED_RANKS`` ranks, every rank's facts reach rank 0 and the record lists
them. Beyond, what reaches rank 0 would grow with the world size (about 1.9 KB a rank:
7.6 MB at 4,096 ranks, a 2 MB record), so each rank writes its own facts to
``record/<stamp>.ranks/rank-<N>.json`` and the record names that folder instead.
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
#: Worlds up to this size send every rank's facts to rank 0; larger ones write per-rank files.
MAX_GATHERED_RANKS = 64


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

    from ddp_hpc.version import __version__

    tools = {"mpi": ["mpiexec", "--version"], "slurm": ["sinfo", "--version"], "pbs": ["qstat", "--version"]}
    with ThreadPoolExecutor(len(tools)) as pool:  # at the start of every run: in parallel
        lines = dict(zip(tools, pool.map(_first_line, tools.values())))
    return {"python": platform.python_version(), "torch": torch.__version__, "ddp_hpc": __version__,
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
                 ranks: Sequence[dict[str, Any]], start_step: int, cwd: Path, world_size: int | None = None,
                 rank_files: str | None = None, nodes: int | None = None) -> dict[str, Any]:
    """The record, from every rank's facts (gathered to rank 0), or for a large world from
    rank 0's alone, naming the folder of per-rank files (``rank_files``) and the node count."""
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
        "world_size": len(ranks) if world_size is None else world_size,
        "hosts": sorted({row["host"] for row in rank_rows}) if rank_files is None else [],
        "nodes": len({row["host"] for row in rank_rows}) if nodes is None else nodes,
        "ranks": rank_rows if rank_files is None else [],
        # Relative to the run folder: one JSON file a rank, the facts listed above otherwise.
        "rank_files": rank_files,
        # Rank 0's variables; other ranks' only where they differ (null: not set there).
        "environment": base,
        "environment_differences": differences,
        "versions": versions(),
        "packages": packages(),
        "git": git_state(cwd),
    }


def record_stamp() -> str:
    """The UTC time that names one (re)start's record (and its per-rank folder)."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def rank_files_folder(stamp: str, start_step: int) -> str:
    """Where each rank's facts go in a large world, relative to the run folder."""
    return f"{RECORD_DIR}/{stamp}-step{start_step}.ranks"


def write_rank_facts(run_path: Path, folder: str, facts: dict[str, Any]) -> Path:
    """One rank's facts as ``<folder>/rank-<N>.json`` (atomic; not fsynced: thousands of ranks
    write at once and a lost file is only a lost record)."""
    target = run_path / folder
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"rank-{facts['rank']}.json"
    atomic_write(path, json.dumps(facts, indent=1, sort_keys=True, default=str) + "\n", durable=False)
    return path


def write_record(run_path: Path, record: dict[str, Any], stamp: str | None = None) -> Path:
    folder = run_path / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stamp = stamp or record_stamp()
    path = folder / f"{stamp}-step{record['start_step']}.json"
    atomic_write(path, json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
    return path

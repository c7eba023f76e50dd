"""Count the exit statuses of a DDP script that never calls destroy_process_group, run
again and again: under plain torchrun, and under MPICH through ``ddp-hpc run``.

    python benchmarks/exit_statuses.py --runs 30 --launcher mpich      # ddp-hpc run
    python benchmarks/exit_statuses.py --runs 30 --launcher torchrun   # plain torchrun
    python benchmarks/exit_statuses.py --runs 30 --launcher mpich --exec   # ddp-hpc run --exec

Each run starts 2 ranks of tests/scripts/ddp_no_destroy.py; the launcher's exit status is
counted, and so are the runs where a rank aborted in gloo's teardown ("terminate called
without an active exception": the rank dies of SIGABRT, 134; mpiexec passes 134 on, torchrun
reports its own 1). Prints one line per run and a summary line. Run it from the repository with
the project's venv first on PATH (``ddp-hpc`` and ``torchrun`` from it).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "ddp_no_destroy.py"


def command(launcher: str, nproc: int, exec_as_typed: bool) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(SCRIPT)]
    mpiexec = shutil.which("mpiexec.mpich") or shutil.which("mpiexec.hydra")
    if mpiexec is None:
        raise SystemExit("MPICH is not installed (mpiexec.mpich)")
    shim = [str(Path(sys.executable).parent / "ddp-hpc"), "run", *(["--exec"] if exec_as_typed else []), "--"]
    return [mpiexec, "-n", str(nproc), *shim, sys.executable, str(SCRIPT)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--launcher", choices=("torchrun", "mpich"), default="mpich")
    parser.add_argument("--exec", action="store_true", help="ddp-hpc run --exec (no script runner)")
    args = parser.parse_args()
    argv = command(args.launcher, args.nproc, args.exec)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    statuses: collections.Counter[int] = collections.Counter()
    aborts = 0
    started = time.monotonic()
    for index in range(args.runs):
        began = time.monotonic()
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        aborted = "terminate called without an active exception" in result.stderr
        aborts += aborted
        statuses[result.returncode] += 1
        print(f"run {index + 1}: exit {result.returncode}{' (terminate called)' if aborted else ''} "
              f"in {time.monotonic() - began:.1f} s", flush=True)
    label = f"{args.launcher}{' --exec' if args.exec else ''}"
    summary = ", ".join(f"exit {code}: {count}" for code, count in sorted(statuses.items()))
    print(f"{label}, {args.runs} runs of {args.nproc} ranks in {time.monotonic() - started:.0f} s: {summary}; "
          f"runs with a rank aborted in teardown ('terminate called'): {aborts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Environment staging on a real SLURM cluster: a rendered ``--stage-env`` job on 2 nodes,
2 ranks each, whose nodes time ``import torch`` from the shared environment and from their
node-local copy, and whose ranks report where torch came from and how long it took.

    python benchmarks/stage_env.py                                      # the n1/n2 test cluster
    SLURM_CONF=/etc/slurm-mh/slurm.conf python benchmarks/stage_env.py --world multihost --partition hosts

Prints the job's staging lines and merges the figures into bench.json (key ``stage``, one
entry per ``--world``). The pack is timed apart (``ddp-hpc stage pack`` into a fresh cache
first), so the job finds it up to date. Run it from the repository with the project's venv
first on PATH. The copies and the archive are deleted at the end (they are rebuilt from the
environment).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ddp_hpc.bench.results_file import merge_into  # noqa: E402

PROBE = ("import os, time\nt = time.perf_counter()\nimport torch\n"
         "print(f\"rank {os.environ['RANK']} node {os.environ['SLURMD_NODENAME']} import torch "
         "{time.perf_counter() - t:.2f} s from {torch.__file__}\", flush=True)\n")
_COPY = re.compile(r"ddp_hpc: stage: node (\d+)/(\d+) \((\S+)\): (\S+) from (.+?), (\d+) MB in ([\d.]+) s")
_IMPORT = re.compile(r"ddp_hpc: stage: node (\S+): import torch: ([\d.]+) s from the shared copy \((\S+)\), "
                     r"([\d.]+) s from the node-local copy \((\S+)\)")
_RANK = re.compile(r"rank (\d+) node (\S+) import torch ([\d.]+) s from (\S+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default="n1n2", help="name of the entry in bench.json (n1n2, multihost)")
    parser.add_argument("--partition", default=None, help="default: the slurm-cpu profile's (debug)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "bench.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddp_hpc-stage-bench-", dir="/tmp"))
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache")}
    try:
        started = time.monotonic()
        subprocess.run(["ddp-hpc", "stage", "pack"], env=env, check=True, capture_output=True)
        pack_s = time.monotonic() - started
        (work / "probe.py").write_text(PROBE)
        script = work / "job.sbatch"
        subprocess.run(["ddp-hpc", "render", "slurm", "--sbatch", "--nodes", "2", "--tasks-per-node", "2",
                        "--walltime", "20", "--stage-env", "--stage-dir", str(work / "node-local"),
                        "--run-dir", str(work / "runs"), "--job-name", "stage-bench",
                        "--env", "DDP_HPC_STAGE_TIME_IMPORT=torch", "-o", str(script),
                        *(["--partition", args.partition] if args.partition else []),
                        "--", "python", str(work / "probe.py")], env=env, check=True, cwd=work)
        (work / "logs").mkdir()
        started = time.monotonic()
        job = subprocess.run(["sbatch", "--wait", str(script)], env=env, cwd=work, capture_output=True, text=True)
        job_s = time.monotonic() - started
        logs = list((work / "logs").glob("stage-bench-*.out"))
        log = logs[0].read_text() if logs else ""
        if job.returncode != 0:
            raise SystemExit(f"the job failed ({job.stderr.strip()}):\n{log[-3000:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(line for line in log.splitlines() if line.startswith(("ddp_hpc: stage", "rank "))))
    copies = [{"node": m[2], "index": int(m[0]), "source": "shared archive" if m[4].startswith("/") else m[4],
               "mb": int(m[5]), "seconds": float(m[6])} for m in _COPY.findall(log)]
    imports = [{"node": m[0], "shared_s": float(m[1]), "staged_s": float(m[3])} for m in _IMPORT.findall(log)]
    ranks = [{"rank": int(m[0]), "node": m[1], "import_s": float(m[2]),
              "from_node_local_copy": "/ddp_hpc-env-" in m[3]} for m in _RANK.findall(log)]
    entry = {"nodes": 2, "ranks_per_node": 2, "pack_s": round(pack_s, 2), "job_s": round(job_s, 2),
             "copies": copies, "import_torch_per_node": imports, "ranks": ranks,
             "machine": "2-core VM shared with other helpers' test runs, torch 2.13.0+cpu, one disk for "
                        "'shared' and 'node-local' alike"}
    output = Path(args.output)
    stage = json.loads(output.read_text()).get("stage", {}) if output.exists() else {}
    merge_into(output, {"stage": {**stage, args.world: entry}})
    print(json.dumps(entry, indent=1))


if __name__ == "__main__":
    main()

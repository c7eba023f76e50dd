"""FSDP2 against DDP: each rank's parameter plus optimizer-state bytes, and the digits job's
test accuracy, under torchrun and MPICH.

    python benchmarks/fsdp2_memory.py                          # 2 and 4 ranks, both launchers, digits
    python benchmarks/fsdp2_memory.py --sizes 2 --launchers torchrun --no-digits

For each launcher and world size N it trains the synthetic job (Adam, a few steps) once with
``training.strategy=ddp`` and once with ``fsdp2`` through ``ddp-hpc launch``, reads each
rank's ``state_bytes_per_rank`` from ``summary.json`` and prints them with the fsdp2/ddp
ratio against the target 1/N + 10%. Then it trains the digits job on 2 ranks (torchrun) with
the same config under both strategies and prints their test accuracies. Run it from the
repository with the project's venv first on PATH. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DDP_HPC = str(Path(sys.executable).parent / "ddp-hpc")
SYNTHETIC = [str(REPO / "configs" / "synthetic.yaml"), "training.optimizer=adam", "training.epochs=1",
             "training.max_steps=3", "job.params.samples=1024", "job.params.val_samples=128",
             "logging.progress=never", "logging.plot=false"]
DIGITS = [str(REPO / "configs" / "digits.yaml"), "logging.progress=never", "logging.plot=false",
          "validation.early_stopping.patience=null"]


def train(runs: Path, name: str, launcher: str, nproc: int, config: list[str], strategy: str) -> dict:
    extra = ["fsdp.wrap=[Linear]"] if strategy == "fsdp2" and "synthetic" in config[0] else []
    argv = [DDP_HPC, "launch", "--nproc", str(nproc), "--launcher", launcher, "--", DDP_HPC, "train", *config,
            f"training.strategy={strategy}", *extra, f"logging.run_dir={runs}", f"logging.name={name}"]
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    summary = json.loads((runs / name / "summary.json").read_text())
    summary["bench_wall_s"] = round(time.perf_counter() - started, 1)
    return summary


def memory_table(runs: Path, launchers: list[str], sizes: list[int]) -> bool:
    print(f"{'launcher':9} {'N':>2} {'ddp bytes/rank':>15} {'fsdp2 bytes/rank (max)':>23} {'ratio':>7} "
          f"{'target 1.1/N':>12}  ok")
    ok = True
    for launcher in launchers:
        for nproc in sizes:
            ddp = train(runs, f"ddp-{launcher}-{nproc}", launcher, nproc, SYNTHETIC, "ddp")
            fsdp = train(runs, f"fsdp2-{launcher}-{nproc}", launcher, nproc, SYNTHETIC, "fsdp2")
            whole, held = max(ddp["state_bytes_per_rank"]), max(fsdp["state_bytes_per_rank"])
            ratio, target = held / whole, 1.1 / nproc
            ok &= ratio <= target
            print(f"{launcher:9} {nproc:>2} {whole:>15,} {held:>23,} {ratio:>7.4f} {target:>12.4f}  "
                  f"{'yes' if ratio <= target else 'NO'}   (fsdp2 per rank: {fsdp['state_bytes_per_rank']})")
    return ok


def digits_accuracy(runs: Path) -> bool:
    accuracy = {}
    for strategy in ("ddp", "fsdp2"):
        summary = train(runs, f"digits-{strategy}", "torchrun", 2, DIGITS, strategy)
        accuracy[strategy] = summary["test"]["accuracy"]
        print(f"digits, 2 ranks (torchrun), {strategy:5}: test accuracy {accuracy[strategy]:.4f} "
              f"({summary['epochs_completed']} epochs, {summary['bench_wall_s']} s)")
    gap = abs(accuracy["fsdp2"] - accuracy["ddp"])
    print(f"digits: |fsdp2 - ddp| = {gap:.4f} (target <= 0.01): {'yes' if gap <= 0.01 else 'NO'}")
    return gap <= 0.01


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4", help="world sizes, N,N,...")
    parser.add_argument("--launchers", default="torchrun,mpich", help="torchrun, mpich, openmpi")
    parser.add_argument("--no-digits", action="store_true", help="skip the digits accuracy comparison")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp2-bench-") as folder:
        ok = memory_table(Path(folder), args.launchers.split(","), [int(n) for n in args.sizes.split(",")])
        if not args.no_digits:
            ok &= digits_accuracy(Path(folder))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

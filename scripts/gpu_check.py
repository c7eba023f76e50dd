"""The GPU check behind scripts/gpu-check.sh: every gpu test and the GPU figures, one JSON file.

Steps, each recorded with its outcome and wall time:
1. ``pytest -m gpu`` (``"gpu or gpu2"`` where torch sees two or more GPUs) over the test files
   that mark tests gpu or gpu2 (found by their text, so that no other test module, nor its
   imports, is collected), with a JUnit XML report read back test by test;
2. ``ddp-hpc bench mfu``: the Trainer against a hand-written loop on the device, fp32, TF32
   and bf16, with MFU;
3. ``ddp-hpc bench checkpoints --sizes 1``: each format's and mode's stall beside
   one pinned device-to-host copy of the same bytes;
4. ``scripts/gpu_fence_cost.py``: what NCCL in-job recovery adds to a step (the step fence),
   and how long ``ProcessGroup.abort`` takes.
``--cpu`` is the dry run: the same steps on CPU ranks with small sizes (the gpu tests then skip,
each with its reason). Exit status: 0 when every step ran and no test failed, 1 otherwise,
2 for bad arguments or, without ``--cpu``, no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The whole check should end within this on one GPU (issue 39); the JSON says if it did not.
BUDGET_S = 360
#: A step still running after this is ended and recorded as not completed.
STEP_TIMEOUT_S = 900
GPU_MARK = re.compile(r"mark\.gpu2?\b")


@dataclass(frozen=True)
class Sizes:
    """What the figures run at: the real check, or the dry run's small sizes."""

    device: str
    mfu_args: tuple[str, ...]
    checkpoint_mb: int
    checkpoint_saves: int
    fence_args: tuple[str, ...]


GPU = Sizes("cuda", (), checkpoint_mb=1000, checkpoint_saves=3, fence_args=())
DRY_RUN = Sizes("cpu", ("--quick",), checkpoint_mb=8, checkpoint_saves=2,
                fence_args=("--hidden", "64", "--layers", "2", "--pairs", "2", "--steps", "3"))


def gpu_test_files(tests: Path) -> list[Path]:
    """The test files that mark a test (or the module) gpu or gpu2."""
    return sorted(path for path in tests.glob("test_*.py") if GPU_MARK.search(path.read_text(encoding="utf-8")))


def read_junit(path: Path) -> list[dict[str, Any]]:
    """Each test case of a JUnit XML report: its id, outcome and time (and why, if not passed)."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(child)
            if found is not None:
                outcome, message = name, (found.get("message") or found.text or "").strip()[:500]
                break
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cases.append({"test": test_id, "outcome": outcome, "time_s": float(case.get("time") or 0.0),
                      **({"message": message} if message else {})})
    return cases


def passed(report: dict[str, Any]) -> bool:
    """True when every step ran and no test failed or errored."""
    bad_tests = [t for t in report["tests"] if t["outcome"] in ("failed", "error")]
    return not bad_tests and all(step["ok"] for step in report["steps"])


def _run(name: str, argv: list[str], report: dict[str, Any], timeout: float) -> subprocess.CompletedProcess | None:
    started = time.monotonic()
    print(f"gpu-check: {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        report["steps"].append({"step": name, "ok": False, "wall_s": round(time.monotonic() - started, 1),
                                "error": f"did not end within {timeout:.0f} s"})
        return None
    step = {"step": name, "ok": done.returncode == 0, "returncode": done.returncode,
            "wall_s": round(time.monotonic() - started, 1), "printed": done.stdout.strip().splitlines()[-40:]}
    if done.returncode != 0:
        step["error"] = (done.stderr.strip() or done.stdout.strip()).splitlines()[-12:]
    report["steps"].append(step)
    return done


def run_tests(python: str, paths: list[Path], marker: str, report: dict[str, Any], workdir: Path) -> None:
    if not paths:
        report["steps"].append({"step": "pytest", "ok": False, "error": "no test file marks a test gpu or gpu2"})
        return
    junit = workdir / "junit.xml"
    done = _run("pytest", [python, "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-q", "-rs",
                           f"--junitxml={junit}", *map(str, paths)], report, timeout=STEP_TIMEOUT_S)
    report["pytest_marker"] = marker
    if junit.exists():
        report["tests"] = read_junit(junit)
    if done is not None and done.returncode == 5:  # pytest: nothing collected
        report["steps"][-1]["error"] = [f"no test was selected by -m {marker!r}"]


def run_figures(python: str, sizes: Sizes, report: dict[str, Any], workdir: Path) -> None:
    output = workdir / "figures.json"
    common = ["--device", sizes.device, "--output", str(output)]
    _run("bench mfu", [python, "-m", "ddp_hpc", "bench", "mfu", *common, *sizes.mfu_args], report,
         timeout=STEP_TIMEOUT_S)
    _run("bench checkpoints", [python, "-m", "ddp_hpc", "bench", "checkpoints", *common, "--sizes", "1",
                               "--mb", str(sizes.checkpoint_mb), "--saves", str(sizes.checkpoint_saves)], report,
         timeout=STEP_TIMEOUT_S)
    fence = _run("fence cost", [python, str(ROOT / "scripts" / "gpu_fence_cost.py"), "--device", sizes.device,
                                *sizes.fence_args], report, timeout=STEP_TIMEOUT_S)
    if fence is not None and fence.returncode == 0:
        report["figures"]["fence_cost"] = json.loads(fence.stdout.strip().splitlines()[-1])
    if output.exists():
        figures = json.loads(output.read_text())
        report["figures"].update({key: figures[key] for key in ("device_loops", "checkpoint_formats") if key in figures})
    failed_modes = [f"{run['world_size']} rank(s) {mode['format']} {'background' if mode['background'] else 'sync'}: "
                    f"{mode['error']}" for run in report["figures"].get("checkpoint_formats", {}).get("runs", [])
                    for mode in run["modes"] if mode["error"]]
    if failed_modes:  # the bench records a mode that raised and goes on; the check does not pass with it
        report["steps"].append({"step": "every checkpoint mode saved", "ok": False, "error": failed_modes})


#: Asked in a process of its own: this one holds no CUDA context while the tests and bench run.
DEVICE_QUERY = """import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"card": torch.cuda.get_device_name(0) if cuda else None,
                  "cards": torch.cuda.device_count() if cuda else 0,
                  "compute_capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
                  "torch": torch.__version__, "cuda": torch.version.cuda}))"""


def about(python: str, dry_run: bool) -> dict[str, Any]:
    device = json.loads(subprocess.run([python, "-c", DEVICE_QUERY], capture_output=True, text=True,
                                       check=True).stdout.strip().splitlines()[-1])
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": dry_run, **device,
            "python": platform.python_version(), "host": platform.node(), "ddp_hpc_commit": commit or None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default="gpu-check.json", help="the JSON file (default: gpu-check.json)")
    parser.add_argument("--cpu", action="store_true", help="the dry run: the same steps on CPU, small sizes")
    parser.add_argument("--tests", nargs="+", type=Path, metavar="PATH",
                        help="test files instead of those that mark tests gpu or gpu2")
    args = parser.parse_args(argv)
    started = time.monotonic()
    python = sys.executable
    report: dict[str, Any] = {"gpu_check": about(python, args.cpu), "steps": [], "tests": [], "figures": {}}
    info = report["gpu_check"]
    if not args.cpu and not info["cards"]:
        print(f"gpu-check: torch {info['torch']} sees no CUDA device here: run it on a GPU host, or "
              f"scripts/gpu-check.sh --cpu for the dry run", file=sys.stderr)
        return 2
    marker = "gpu or gpu2" if info["cards"] >= 2 else "gpu"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        run_tests(python, args.tests or gpu_test_files(ROOT / "tests"), marker, report, Path(tmp))
        run_figures(python, DRY_RUN if args.cpu else GPU, report, Path(tmp))
    info["wall_s"] = round(time.monotonic() - started, 1)
    info["within_budget"] = info["wall_s"] <= BUDGET_S
    counts: dict[str, int] = {}
    for test in report["tests"]:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    report["tests_summary"] = counts
    report["passed"] = passed(report)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, output)
    for step in report["steps"]:
        print(f"gpu-check: {step['step']}: {'ok' if step['ok'] else 'FAILED'} ({step.get('wall_s', 0)} s)")
        for line in step.get("printed", []) if step["step"] != "pytest" else []:
            print(f"  {line}")
    print(f"gpu-check: tests {counts}; {'passed' if report['passed'] else 'FAILED'} in {info['wall_s']} s; "
          f"{output}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

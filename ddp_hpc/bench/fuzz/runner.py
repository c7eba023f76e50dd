"""Running recovery cases and judging them: each case's faulted launch against the same
case uninterrupted (its reference, run once per shape), compared bit for bit.

``python -m ddp_hpc.bench.recovery_fuzz --cases 200 --seed S [--jobs 1] [--replay CASE_SEED]
[--out DIR]``: one line per case as it finishes, a table at the end, the replay line of each
failed case, exit 1 if any failed. ``DIR/results.jsonl`` holds one JSON line per finished
case (rewritten whole, atomically, after each), ``DIR/logs/`` the launch output of the
failed ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_hpc.bench.fuzz.cases import Case, case_seeds, draw_case, stated_exception
from ddp_hpc.contract import FUZZ_DEVICE_VAR, SNAPSHOT_DIR_VAR, VAR_PREFIX, atomic_write

#: Seconds of silence after which the launch ends a frozen (SIGSTOPped) rank.
HANG_TIMEOUT_S = 5
#: A launch that runs longer is ended (its whole process group) and its case failed.
DEFAULT_TIMEOUT_S = 180.0
#: Variables of an outer launcher that would make the ranks take themselves for its tasks.
LAUNCHER_PREFIXES = ("OMPI_", "PMI", "PMIX_", "MPI_LOCAL", "SLURM_", "PALS_", "MV2_", "TORCHELASTIC", VAR_PREFIX)
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "RUN_DIR"}

#: The launches running now (their process groups), ended on an interrupt; after it none starts.
_RUNNING: set[int] = set()
_STOPPING = threading.Event()

IDENTICAL_IN_JOB = "identical (recovered in the job)"
IDENTICAL_FELL_BACK = "identical (fell back to a restart in place)"


@dataclass(frozen=True)
class Launch:
    status: int | None  # None: timed out
    seconds: float
    output: str
    finals: tuple[dict[str, Any], ...] | None  # each rank's final file, where all were written
    fired: tuple[str, ...]  # the fault markers' contents


@dataclass(frozen=True)
class Result:
    seed: int
    shape: str
    faults: str
    verdict: str  # one of the IDENTICAL_* lines, "stated exception: ...", "failed: ..."
    seconds: float
    fired: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.verdict.startswith("failed")

    def line(self) -> str:
        return f"case {self.seed}: {self.shape} | {self.faults} | {self.verdict} | {self.seconds:.1f} s"


#: The devices a run may name, and the strategies each can run (gloo has no reduce-scatter of
#: CUDA tensors, which FSDP2 needs: FSDP2 cases on one GPU shared by several ranks cannot run).
DEVICE_STRATEGIES = {"cpu": ("ddp", "fsdp2"), "cuda": ("ddp",)}


def launch_case(case: Case, work: Path, *, faulted: bool, timeout_s: float, device: str = "cpu") -> Launch:
    """One ``ddp-hpc launch --recover`` of ``case`` (without its faults unless ``faulted``)
    in a fresh run folder under ``work``; its outcome and each rank's final state."""
    import torch

    if not faulted:
        case = dataclasses.replace(case, faults=(), recover=1, shrink=False)
    work.mkdir(parents=True, exist_ok=True)
    run_dir, snapshots = work / "run", work / "node-memory"
    case_file = work / "case.json"
    case_file.write_text(case.to_json())
    command = [sys.executable, "-m", "ddp_hpc", "launch", "--nproc", str(case.shape.world_size),
               "--recover", str(max(case.recover, 1)), "--max-restarts", "1", "--hang-timeout", str(HANG_TIMEOUT_S),
               *(["--shrink"] if case.shrink else []), "--",
               sys.executable, "-m", "ddp_hpc.bench.fuzz.loop", str(case_file)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES}
    env.update({"RUN_DIR": str(run_dir), SNAPSHOT_DIR_VAR: str(snapshots), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", FUZZ_DEVICE_VAR: device})
    if device == "cuda":  # deterministic cuBLAS: a redone step sums as the first time did
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if _STOPPING.is_set():
        raise KeyboardInterrupt("the fuzz run was interrupted")
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    _RUNNING.add(process.pid)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        status: int | None = process.returncode
    except subprocess.TimeoutExpired:
        _end_group(process.pid)
        output, _ = process.communicate()
        status = None
    seconds = time.monotonic() - started
    _end_group(process.pid)  # a rank left behind (stopped, say) goes with its launch
    _RUNNING.discard(process.pid)
    paths = [run_dir / "final" / f"rank-{slot}.pt" for slot in range(case.shape.world_size)]
    finals = None
    # After a shrink the lost slots have no rank at the end: the others' files are the end.
    if all(path.exists() for path in paths) or case.shrink and any(path.exists() for path in paths):
        finals = tuple(torch.load(path, weights_only=False, map_location="cpu") for path in paths if path.exists())
    fired = tuple(sorted(p.read_text().strip() for p in run_dir.glob("fault-*-slot-*"))) if run_dir.exists() else ()
    return Launch(status=status, seconds=seconds, output=output, finals=finals, fired=fired)


def _end_group(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process ends only once continued
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return


def first_difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """Where two final states first differ (with the max abs difference of tensors), or None."""
    import torch

    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return f"{path}: a tensor against {type(actual).__name__}"
        if expected.shape != actual.shape or expected.dtype != actual.dtype:
            return f"{path}: {tuple(expected.shape)} {expected.dtype} against {tuple(actual.shape)} {actual.dtype}"
        if torch.equal(expected, actual):
            return None
        if expected.is_floating_point():
            diff = (expected.double() - actual.double()).abs().max().item()
            return f"{path}: max abs diff {diff:.3g}"
        return f"{path}: differs"
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            return f"{path}: keys {sorted(map(str, expected))} against {sorted(map(str, actual))}"
        for key in expected:
            found = first_difference(expected[key], actual[key], f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            return f"{path}: {len(expected)} items against {len(actual)}"
        for index, (one, other) in enumerate(zip(expected, actual)):
            found = first_difference(one, other, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if expected == actual else f"{path}: {expected!r} against {actual!r}"


def judge(case: Case, reference: Launch, faulted: Launch) -> str:
    """The verdict of one case (see ``Result.verdict``)."""
    if reference.status != 0 or reference.finals is None:
        why = "timeout" if reference.status is None else f"exit {reference.status}"
        return f"failed: the uninterrupted run ({why})"
    if faulted.status is None:
        return "failed: timeout"
    if faulted.status != 0:
        return f"failed: exit {faulted.status}"
    if faulted.finals is None:
        return "failed: a rank wrote no final state"
    if not faulted.fired:
        return "failed: no fault fired (the fuzzer's hooks missed their moment)"
    exception = stated_exception(case)
    if exception is not None:
        return f"stated exception: {exception}"
    for slot, (expected, actual) in enumerate(zip(reference.finals, faulted.finals)):
        found = first_difference(expected["state"], actual["state"])
        if found is not None:
            return f"failed: mismatch on rank {slot}: {found}"
    verdict = IDENTICAL_FELL_BACK if any(final["meta"]["restarts"] for final in faulted.finals) else IDENTICAL_IN_JOB
    if len(faulted.fired) < case.losses:  # e.g. a replacement's fault, where the launch gave up before it started
        verdict += f" [{len(faulted.fired)} of {case.losses} drawn losses fired]"
    return verdict


class Fuzz:
    """Runs cases (``--jobs`` at a time), each shape's reference once."""

    def __init__(self, out: Path, timeout_s: float = DEFAULT_TIMEOUT_S, keep: bool = False,
                 device: str = "cpu") -> None:
        self.out, self.timeout_s, self.keep, self.device = out, timeout_s, keep, device
        self.results: list[Result] = []
        self._references: dict[str, Launch] = {}
        self._reference_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.work = Path(tempfile.mkdtemp(prefix="ddp_hpc-fuzz-"))

    def reference(self, case: Case) -> Launch:
        key = case.reference_key()
        with self._lock:
            lock = self._reference_locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._references:
                work = self.work / f"reference-{case.seed >> 4}"
                launch = launch_case(case, work, faulted=False, timeout_s=self.timeout_s, device=self.device)
                if launch.status != 0:
                    self._log(case, "reference", launch)
                if not self.keep:
                    shutil.rmtree(work, ignore_errors=True)
                self._references[key] = launch
            return self._references[key]

    def run_case(self, seed: int) -> Result:
        case = draw_case(seed)
        started = time.monotonic()
        reference = self.reference(case)
        work = self.work / f"case-{seed}"
        faulted = launch_case(case, work, faulted=True, timeout_s=self.timeout_s, device=self.device)
        verdict = judge(case, reference, faulted)
        result = Result(seed=seed, shape=case.summary(), faults=case.faults_summary(), verdict=verdict,
                        seconds=round(time.monotonic() - started, 1), fired=faulted.fired)
        if result.failed:
            self._log(case, "faulted", faulted)
        if not self.keep:
            shutil.rmtree(work, ignore_errors=True)
        with self._lock:
            self.results.append(result)
            lines = "".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in self.results)
            atomic_write(self.out / "results.jsonl", lines, durable=False)
        return result

    def _log(self, case: Case, which: str, launch: Launch) -> None:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        atomic_write(logs / f"{case.seed}-{which}.log", f"{case.to_json()}\n{launch.output}", durable=False)

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def runnable_seeds(run_seed: int, count: int, strategies: Sequence[str]) -> list[int]:
    """The first ``count`` case seeds of the run whose drawn strategy is one of ``strategies``
    (all of them on cpu: the run's seeds as drawn)."""
    seeds: list[int] = []
    drawn = count
    while len(seeds) < count:
        seeds = [s for s in case_seeds(run_seed, drawn) if draw_case(s).shape.strategy in strategies][:count]
        drawn *= 2
    return seeds


def table(results: Sequence[Result]) -> str:
    identical = [r for r in results if r.verdict.startswith("identical")]
    rows = [("cases", len(results)), ("identical", len(identical)),
            ("  recovered in the job", sum(r.verdict.startswith(IDENTICAL_IN_JOB) for r in results)),
            ("  fell back to a restart in place", sum(r.verdict.startswith(IDENTICAL_FELL_BACK) for r in results)),
            ("stated exceptions", sum(r.verdict.startswith("stated exception") for r in results)),
            ("failed", sum(r.failed for r in results))]
    width = max(len(name) for name, _ in rows)
    text = "\n".join(f"{name:<{width}}  {count}" for name, count in rows)
    if results:
        text += f"\nmean seconds per case  {sum(r.seconds for r in results) / len(results):.1f}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_hpc.bench.recovery_fuzz",
                                     description="Draw in-job recovery cases, run each under ddp-hpc launch "
                                                 "--recover with its faults and without, compare bit for bit.")
    parser.add_argument("--cases", type=int, default=200, help="cases to draw (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed, from which the case seeds are drawn")
    parser.add_argument("--jobs", type=int, default=1, help="cases run side by side (default 1)")
    parser.add_argument("--replay", type=int, action="append", metavar="CASE_SEED",
                        help="run this case only (repeatable); its seed is on each case's line")
    parser.add_argument("--out", type=Path, default=Path("runs/recovery_fuzz"),
                        help="results.jsonl and the failed cases' logs (default runs/recovery_fuzz)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds a launch may take (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (under a temp folder)")
    parser.add_argument("--device", choices=tuple(DEVICE_STRATEGIES), default="cpu",
                        help="the ranks' device (default cpu); cuda: every rank on one GPU over gloo, DDP cases only "
                             "(the drawn FSDP2 cases are passed over, their seeds kept)")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.jobs < 1 or args.timeout <= 0:
        print("recovery_fuzz: --cases, --jobs and --timeout must be positive", file=sys.stderr)
        return 2
    seeds = args.replay or runnable_seeds(args.seed, args.cases, DEVICE_STRATEGIES[args.device])
    args.out.mkdir(parents=True, exist_ok=True)
    fuzz = Fuzz(args.out, args.timeout, args.keep, args.device)
    print(f"recovery_fuzz: {len(seeds)} case(s), seed {args.seed}, on {args.device}, results in {args.out / 'results.jsonl'}",
          flush=True)
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        for future in as_completed([pool.submit(fuzz.run_case, seed) for seed in seeds]):
            print(future.result().line(), flush=True)
    except KeyboardInterrupt:
        _STOPPING.set()
        pool.shutdown(wait=False, cancel_futures=True)
        for pid in list(_RUNNING):
            try:
                _end_group(pid)
            except KeyboardInterrupt:  # a second Ctrl-C (or the signal passed on twice) ends them all the same
                _end_group(pid)
        print(f"recovery_fuzz: interrupted; the {len(fuzz.results)} finished case(s) are in "
              f"{args.out / 'results.jsonl'}", file=sys.stderr)
        return 130
    finally:
        pool.shutdown(wait=False)
        if not args.keep:
            fuzz.close()
    print(table(fuzz.results))
    failed = [r for r in fuzz.results if r.failed]
    for result in failed:
        print(f"replay: python -m ddp_hpc.bench.recovery_fuzz --replay {result.seed}   # {result.verdict}")
    return 1 if failed else 0

#!/usr/bin/env python3
"""Mutation check of the engine's guarantees: does a test fail when a guarantee is gone?

Each mutant removes or inverts one guarantee (restore, dcp completeness, a stop any rank
asks for, the deadline, the watchdog's exit status) in a temporary copy of this checkout;
the working tree is never touched. The mutant's named tests then run against the copy
under a throwaway venv whose ``ddp_hpc`` is the copy's (tests give the ranks they launch a
PYTHONPATH of their own, so PYTHONPATH alone would leave those ranks on the editable
install), and a table says which failed. A mutant no test fails on *survives*: that guarantee could break
with CI green. Standard library only; the tests run with the packages of the checkout's .venv.

    scripts/mutation-check.py                  # every mutant (about 10 minutes on 2 cores)
    scripts/mutation-check.py any-rank-stop    # the ones named
    scripts/mutation-check.py --baseline       # also the same tests unmutated (all must pass)
    scripts/mutation-check.py --list

Exit status: 0 when every mutant was caught (and, with --baseline, the baseline passed),
1 when one survived or the baseline failed, 2 when a mutant no longer applies (its code
moved: update MUTANTS).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Not copied: the copy is for the tests, not a second environment or its outputs.
SKIP = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", "*.egg-info", "runs", "build", "dist")


@dataclass(frozen=True)
class Mutant:
    name: str
    guarantee: str
    path: str      # file in the checkout
    original: str  # text found exactly once in it
    mutated: str   # what replaces it
    tests: tuple[str, ...]  # pytest node ids (a function's id runs all its parameters)


MUTANTS = (
    Mutant("restore-returns-none", "restore: a restart continues from the newest checkpoint",
           "ddp_hpc/engine/checkpoint/checkpointer.py",
           '        caller logs its own)."""\n',
           '        caller logs its own)."""\n        return None\n',
           ("tests/test_engine.py::test_resume_mid_epoch_is_bit_identical_with_rng_scheduler_and_extras",
            "tests/test_checkpoint.py::test_a_sigkill_while_the_temporary_is_half_written_resumes_from_the_previous_checkpoint",
            "tests/test_checkpoint.py::test_pruning_keeps_the_newest_readable_checkpoint_after_resuming_from_an_older_one",
            "tests/test_engine_user_facing.py::test_a_refused_checkpoint_neither_counts_toward_keep_last_nor_is_pruned")),
    Mutant("dcp-short-shard-accepted", "dcp completeness: a shard shorter than its metadata says is refused",
           "ddp_hpc/engine/checkpoint/dcp_read.py",
           "        if actual < size:\n",
           "        if False:\n",
           ("tests/test_engine.py::test_an_incomplete_dcp_checkpoint_is_refused_and_the_previous_one_restored",)),
    Mutant("dcp-missing-metadata-not-skipped", "dcp completeness: a folder without .metadata is an interrupted write",
           "ddp_hpc/engine/checkpoint/dcp_read.py",
           "        if not (path / SHARDED_METADATA_FILE).exists():\n",
           "        if False:\n",
           ("tests/test_engine.py::test_an_incomplete_dcp_checkpoint_is_refused_and_the_previous_one_restored",
            "tests/test_engine.py::test_a_first_dcp_checkpoint_whose_write_was_interrupted_is_a_fresh_start")),
    Mutant("any-rank-stop-rank-0-only", "stop: every rank stops once any rank asked (stop.request())",
           "ddp_hpc/engine/stop_agreement.py",
           "        wanted = self.requested or deadline_near\n",
           "        wanted = (self.requested and self.group.is_rank_zero) or deadline_near\n",
           ("tests/test_engine_user_facing.py::test_a_stop_requested_on_rank_1_alone_stops_both_ranks_at_the_same_step",
            "tests/test_engine.py::test_stop_agreement_signal_and_deadline",
            "tests/test_engine.py::test_stop_saves_through_the_checkpointer",
            "tests/test_stop_resume.py::test_resume_on_fewer_and_more_ranks_trains_every_sample_of_the_epoch_once")),
    Mutant("deadline-ignored", "deadline: the ranks stop ahead of the job's walltime",
           "ddp_hpc/engine/deadline.py",
           "    return policy.deadline - now < time_needed(policy, timings, steps_to_next_check, crosses_epoch_end)\n",
           "    return False\n",
           # (test_engine.py's test of the default margin catches it too, but loops until its timeout.)
           ("tests/test_engine.py::test_stop_agreement_signal_and_deadline",
            "tests/test_engine_user_facing.py::test_a_stop_names_what_caused_it_the_deadline_or_a_request",
            "tests/test_stop.py::test_stop_when_the_next_interval_and_a_checkpoint_would_not_fit",
            "tests/test_engine.py::test_a_deadline_already_past_at_the_start_stops_at_the_first_agreement_step")),
    Mutant("watchdog-exit-status-1", "watchdog: a stuck rank ends the job with status 3 (docs/reliability.md)",
           "ddp_hpc/contract/exit_status.py",
           "    WATCHDOG = 3\n",
           "    WATCHDOG = 1\n",
           ("tests/test_reliability.py::test_a_stuck_rank_is_detected_by_the_watchdog",)),
)


@dataclass(frozen=True)
class Outcome:
    run: int
    failed: tuple[str, ...]
    skipped: int
    seconds: float


def checkout_venv() -> Path:
    """The checkout's .venv (torch and the test tools live there)."""
    venv = REPO / ".venv"
    if not (venv / "bin" / "python").exists():
        raise SystemExit(f"mutation-check: no {venv}: scripts/bootstrap.sh test makes it")
    return venv


def overlay_venv(copy: Path, into: Path) -> Path:
    """A venv that imports ``ddp_hpc`` from ``copy`` and everything else from the checkout's
    .venv (its site-packages as a plain path: the editable install's finder is not loaded),
    with the .venv's console scripts (ddp-hpc, torchrun, pytest) pointed at it. Its python."""
    venv = checkout_venv()
    base = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys._base_executable)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    overlay = into / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(overlay)], check=True)
    (site,) = (venv / "lib").glob("python*/site-packages")
    (mine,) = (overlay / "lib").glob("python*/site-packages")
    (mine / "mutant.pth").write_text(f"{copy}\n{site}\n")
    python = overlay / "bin" / "python"
    for script in (venv / "bin").iterdir():
        target = overlay / "bin" / script.name
        if target.exists() or script.is_symlink() or not script.is_file():
            continue
        head, _, rest = script.read_bytes().partition(b"\n")
        if head.startswith(b"#!") and str(venv).encode() in head:
            target.write_bytes(f"#!{python}\n".encode() + rest)
            target.chmod(0o755)
    return python


def copy_checkout(into: Path) -> Path:
    """A copy of the checkout as it is now (uncommitted changes too), without its venv or git."""
    copy = into / "checkout"
    shutil.copytree(REPO, copy, ignore=SKIP, symlinks=True)
    return copy


def apply(mutant: Mutant, copy: Path) -> None:
    target = copy / mutant.path
    text = target.read_text()
    if text.count(mutant.original) != 1:
        raise LookupError(f"{mutant.name}: {mutant.path} holds the text to mutate {text.count(mutant.original)} "
                          f"times, not once (the code moved: update MUTANTS in {Path(__file__).name})")
    target.write_text(text.replace(mutant.original, mutant.mutated))


def run_tests(copy: Path, python: Path, tests: tuple[str, ...], timeout_s: float) -> Outcome:
    report = copy / "mutation-junit.xml"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONDONTWRITEBYTECODE="1")
    # The copy's ddp_hpc, not the editable install's, also where a test sets PYTHONPATH for
    # its ranks (as most do): checked before any test runs.
    where = subprocess.run([str(python), "-c", "import ddp_hpc; print(ddp_hpc.__file__)"], capture_output=True,
                           text=True, env={**env, "PYTHONPATH": str(copy / "tests")}, cwd="/", check=True).stdout.strip()
    if not Path(where).is_relative_to(copy):
        raise RuntimeError(f"the tests would import ddp_hpc from {where}, not from the mutated copy {copy}")
    started = time.monotonic()
    subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                    f"--junitxml={report}", *tests], cwd=copy, env=env, timeout=timeout_s,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report for {' '.join(tests)}")
    run, failed, skipped = 0, [], 0
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        run += 1
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name.removeprefix("tests/"))
        elif case.find("skipped") is not None:
            skipped += 1
    return Outcome(run, tuple(failed), skipped, seconds)


def check(mutant: Mutant | None, tests: tuple[str, ...], timeout_s: float) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="ddp-hpc-mutant-") as tmp:
        copy = copy_checkout(Path(tmp))
        if mutant is not None:
            apply(mutant, copy)
        return run_tests(copy, overlay_venv(copy, Path(tmp)), tests, timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    parser.add_argument("--baseline", action="store_true", help="first run every mutant's tests unmutated")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mutant's test run")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - {m.name for m in MUTANTS})
    if unknown:
        parser.error(f"no mutant {', '.join(unknown)} (--list shows them)")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name}: {mutant.guarantee}\n  {mutant.path}: {mutant.original.strip()!r} -> "
                  f"{mutant.mutated.strip()!r}\n  " + "\n  ".join(mutant.tests))
        return 0
    status = 0
    rows = []
    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        base = check(None, tests, args.timeout)
        print(f"baseline (no mutant): {base.run} tests, {len(base.failed)} failed, {base.skipped} skipped, "
              f"{base.seconds:.0f} s" + (f": {', '.join(base.failed)}" if base.failed else ""), flush=True)
        status = 1 if base.failed or base.skipped else 0
    for mutant in chosen:
        try:
            outcome = check(mutant, mutant.tests, args.timeout)
        except LookupError as exc:
            print(f"mutation-check: {exc}", file=sys.stderr)
            return 2
        survived = not outcome.failed
        status = 1 if survived else status
        rows.append((mutant, outcome))
        print(f"{mutant.name}: {len(outcome.failed)} of {outcome.run} failed ({outcome.skipped} skipped, "
              f"{outcome.seconds:.0f} s){'  SURVIVED' if survived else ''}", flush=True)
    print("\n| mutant | tests run | tests that failed | survived? |\n|---|---|---|---|")
    for mutant, outcome in rows:
        failed = "<br>".join(f"`{name}`" for name in outcome.failed) or "none"
        change = " -> ".join(" + ".join(f"`{line.strip()}`" for line in text.strip().splitlines())
                             for text in (mutant.original, mutant.mutated))
        print(f"| `{mutant.name}` ({mutant.path}: {change}) | "
              f"{outcome.run}{f' ({outcome.skipped} skipped)' if outcome.skipped else ''} | {failed} | "
              f"{'**yes**' if not outcome.failed else 'no'} |")
    return status


if __name__ == "__main__":
    sys.exit(main())

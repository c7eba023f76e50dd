"""``ddp-hpc bench``: overhead, scaling, start-up and communication, side by side.

Every measurement is a real torchrun launch of ``ddp_hpc.bench.worker`` on this machine,
one thread per rank. Paired measurements (Trainer vs hand-written loop, ddp_hpc start-up
vs bare torchrun) alternate round by round, so slow drift of the machine hits both alike.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddp_hpc import __version__
from ddp_hpc.bench.worker import STARTED_AT_VAR
from ddp_hpc.errors import UserError


@dataclass(frozen=True)
class ModelSize:
    name: str
    input_dim: int
    hidden: int
    depth: int
    batch: int
    samples: int

    def parameters(self, classes: int = 10) -> int:
        widths = [self.input_dim] + [self.hidden] * self.depth + [classes]
        return sum(a * b + b for a, b in zip(widths, widths[1:]))

    def args(self) -> list[str]:
        return ["--input-dim", str(self.input_dim), "--hidden", str(self.hidden), "--depth", str(self.depth),
                "--batch", str(self.batch), "--samples", str(self.samples)]


@dataclass(frozen=True)
class Plan:
    rounds: int
    steps: int
    compute_bound: ModelSize
    comm_bound: ModelSize
    world_sizes: tuple[int, ...]
    bucket_sizes_mb: tuple[float, ...]


# Compute-bound: a small MLP on large batches (~4.5 MFLOP per gradient byte).
# Communication-bound: a wide MLP on tiny batches (the gradient all-reduce dominates).
QUICK = Plan(rounds=1, steps=12, compute_bound=ModelSize("compute-bound", 128, 256, 3, 1024, 8192),
             comm_bound=ModelSize("communication-bound", 1024, 1024, 2, 4, 1024), world_sizes=(1, 2),
             bucket_sizes_mb=(25.0,))
FULL = Plan(rounds=3, steps=40, compute_bound=ModelSize("compute-bound", 128, 256, 3, 2048, 32768),
            comm_bound=ModelSize("communication-bound", 2048, 2048, 3, 4, 1024), world_sizes=(1, 2),
            bucket_sizes_mb=(1.0, 25.0, 100.0))


@dataclass
class Results:
    machine: dict[str, Any]
    plan: dict[str, Any]
    overhead: dict[str, Any] = field(default_factory=dict)
    scaling: list[dict[str, Any]] = field(default_factory=list)
    startup: dict[str, Any] = field(default_factory=dict)
    communication: list[dict[str, Any]] = field(default_factory=list)


def machine_info() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "ddp_hpc": __version__, "backend": "gloo", "device": "cpu",
            "date": time.strftime("%Y-%m-%d")}


def launch(mode: str, nproc: int, extra: list[str], workdir: Path, timeout: float = 600) -> dict[str, Any]:
    """One torchrun launch of the worker; its rank-0 JSON result."""
    out = workdir / f"{mode}-{time.monotonic_ns()}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "ddp_hpc.bench.worker", mode, "--out", str(out), "--run-dir", str(workdir), *extra]
    env[STARTED_AT_VAR] = repr(time.time())  # "launch" for the start-up figures
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0 or not out.exists():
        raise UserError(f"benchmark launch {mode} x{nproc} failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def measure_overhead(plan: Plan, workdir: Path, progress) -> dict[str, Any]:
    model, trainer, handwritten = plan.compute_bound, [], []
    for round_index in range(plan.rounds):
        order = ("trainer", "handwritten") if round_index % 2 == 0 else ("handwritten", "trainer")
        for mode in order:
            result = launch(mode, 2, [*model.args(), "--steps", str(plan.steps)], workdir)
            (trainer if mode == "trainer" else handwritten).append(result["median_step_s"])
            progress(f"overhead round {round_index + 1}/{plan.rounds}: {mode} {result['median_step_s'] * 1e3:.2f} ms/step")
    ratio = statistics.median(trainer) / statistics.median(handwritten)
    return {"model": asdict(model), "world_size": 2, "trainer_step_s": trainer, "handwritten_step_s": handwritten,
            "ratio_of_medians": ratio, "target": 1.02}


def measure_scaling(plan: Plan, workdir: Path, progress) -> list[dict[str, Any]]:
    rows = []
    for model in (plan.compute_bound, plan.comm_bound):
        throughput: dict[int, list[float]] = {n: [] for n in plan.world_sizes}
        for round_index in range(plan.rounds):
            for n in plan.world_sizes:
                result = launch("trainer", n, [*model.args(), "--steps", str(plan.steps)], workdir)
                throughput[n].append(result["samples_per_s"])
                progress(f"scaling {model.name} x{n}: {result['samples_per_s']:.0f} samples/s")
        base = statistics.median(throughput[plan.world_sizes[0]])
        for n in plan.world_sizes:
            median = statistics.median(throughput[n])
            rows.append({"model": model.name, "parameters": model.parameters(), "world_size": n,
                         "samples_per_s": median, "runs": throughput[n], "efficiency": median / (n * base)})
    return rows


def measure_startup(plan: Plan, workdir: Path, progress) -> dict[str, Any]:
    """Launch to first step (Trainer, hand-written loop) and to a first all_reduce (bare)."""
    times: dict[str, list[float]] = {"trainer": [], "handwritten": [], "bare": []}
    modes = list(times)
    for round_index in range(max(plan.rounds, 2)):
        for mode in modes[round_index % 3:] + modes[:round_index % 3]:
            args = [] if mode == "bare" else [*plan.compute_bound.args(), "--steps", "2", "--warmup", "0"]
            result = launch(mode, 2, args, workdir)
            times[mode].append(result["first_all_reduce_after_launch_s" if mode == "bare" else "first_step_after_launch_s"])
            progress(f"start-up {mode}: {times[mode][-1]:.2f}s")
    median = {mode: statistics.median(values) for mode, values in times.items()}
    return {"trainer_first_step_s": times["trainer"], "handwritten_first_step_s": times["handwritten"],
            "bare_first_all_reduce_s": times["bare"], "difference_s": median["trainer"] - median["bare"],
            "trainer_minus_handwritten_s": median["trainer"] - median["handwritten"], "target_s": 1.0}


def measure_communication(plan: Plan, workdir: Path, progress) -> list[dict[str, Any]]:
    model = plan.comm_bound
    params = model.parameters()
    rows = []
    raw = {hook: launch("allreduce", 2, ["--numel", str(params), "--steps", str(plan.steps), "--comm-hook", hook],
                        workdir) for hook in ("none", "fp16")}
    for hook, result in raw.items():
        rows.append({"kind": "all_reduce of the gradients alone", "comm_hook": hook, "bucket_mb": None,
                     "median_s": result["median_step_s"], "bytes_per_rank": result["bytes"],
                     "ring_bytes_sent_per_rank": result["bytes"]})  # 2(N-1)/N = 1 at N = 2
        progress(f"all_reduce {hook}: {result['median_step_s'] * 1e3:.2f} ms for {result['bytes'] / 1e6:.1f} MB")
    for hook in ("none", "fp16"):
        for bucket in plan.bucket_sizes_mb:
            result = launch("trainer", 2, [*model.args(), "--steps", str(plan.steps), "--comm-hook", hook,
                                           "--bucket-mb", str(bucket)], workdir)
            rows.append({"kind": "DDP step (communication-bound model)", "comm_hook": hook, "bucket_mb": bucket,
                         "median_s": result["median_step_s"],
                         "bytes_per_rank": params * (2 if hook == "fp16" else 4)})
            progress(f"DDP step hook={hook} bucket={bucket}MB: {result['median_step_s'] * 1e3:.2f} ms")
    return rows


def format_table(results: Results) -> str:
    lines = ["", "== overhead (world size 2, compute-bound model) =="]
    o = results.overhead
    lines.append(f"trainer {statistics.median(o['trainer_step_s']) * 1e3:.2f} ms/step  hand-written "
                 f"{statistics.median(o['handwritten_step_s']) * 1e3:.2f} ms/step  ratio {o['ratio_of_medians']:.3f} "
                 f"(target <= {o['target']})")
    lines.append("== scaling (1 thread per rank) ==")
    for row in results.scaling:
        lines.append(f"{row['model']:<22} {row['parameters'] / 1e6:6.2f}M params  x{row['world_size']}  "
                     f"{row['samples_per_s']:9.0f} samples/s  efficiency {row['efficiency']:.3f}")
    s = results.startup
    lines.append("== start-up (launch to first step / first all_reduce) ==")
    lines.append(f"trainer {statistics.median(s['trainer_first_step_s']):.2f}s  hand-written "
                 f"{statistics.median(s['handwritten_first_step_s']):.2f}s  bare torchrun "
                 f"{statistics.median(s['bare_first_all_reduce_s']):.2f}s  trainer - bare {s['difference_s']:.2f}s "
                 f"(target <= {s['target_s']}s)  trainer - hand-written {s['trainer_minus_handwritten_s']:.2f}s")
    lines.append("== communication (communication-bound model) ==")
    for row in results.communication:
        bucket = f"bucket {row['bucket_mb']:>5} MB" if row["bucket_mb"] else "             "
        lines.append(f"{row['kind']:<38} hook {row['comm_hook']:<4} {bucket}  {row['median_s'] * 1e3:8.2f} ms  "
                     f"{row['bytes_per_rank'] / 1e6:6.1f} MB/rank")
    return "\n".join(lines)


def plot(results: Results, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for model in dict.fromkeys(r["model"] for r in results.scaling):
        rows = [r for r in results.scaling if r["model"] == model]
        ranks = [r["world_size"] for r in rows]
        left.plot(ranks, [r["samples_per_s"] for r in rows], marker="o", label=model)
        left.plot(ranks, [rows[0]["samples_per_s"] * n for n in ranks], linestyle=":", color="grey")
        right.plot(ranks, [r["efficiency"] for r in rows], marker="o", label=model)
    left.set(xlabel="ranks", ylabel="samples/s (log scale)", title="Throughput (dotted: ideal)", xticks=ranks,
             yscale="log")
    right.set(xlabel="ranks", ylabel="throughput(N) / (N x throughput(1))", title="Scaling efficiency",
              ylim=(0, 1.1), xticks=ranks)
    right.axhline(0.95, color="grey", linestyle=":")
    for axis in (left, right):
        axis.legend()
        axis.grid(alpha=0.3)
    fig.suptitle(f"ddp_hpc on {results.machine['cpus']} CPU cores, gloo, 1 thread per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_bench(quick: bool, output: Path, plot_path: Path | None) -> Results:
    plan = QUICK if quick else FULL
    results = Results(machine_info(), {**asdict(plan), "quick": quick})

    def progress(message: str) -> None:
        print(f"bench: {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="ddp-hpc-bench-") as tmp:
        workdir = Path(tmp)
        results.overhead = measure_overhead(plan, workdir, progress)
        results.scaling = measure_scaling(plan, workdir, progress)
        results.startup = measure_startup(plan, workdir, progress)
        results.communication = measure_communication(plan, workdir, progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(asdict(results), indent=2) + "\n")
    print(format_table(results))
    print(f"\nresults: {output}")
    if plot_path is not None:
        if plot(results, plot_path):
            print(f"plot: {plot_path}")
        else:
            print("plot: skipped (pip install matplotlib)")
    return results

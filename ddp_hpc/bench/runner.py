"""``ddp-hpc bench``: overhead, scaling, checkpoint stall, start-up and communication.

Every measurement is a real launch (torchrun, or mpiexec for the start-up figures) of
``ddp_hpc.bench.worker`` on this machine, one thread per rank. Paired measurements
alternate round by round (Trainer and hand-written loop, the start-up variants), so slow
drift of the machine hits both alike, and every paired ratio is reported, not only a
summary of them.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ddp_hpc.bench.report import Results, format_markdown, format_table, ms_list, plot, spread
from ddp_hpc.bench.results_file import check_output, markdown_path, merge_into
from ddp_hpc.contract import BENCH_STARTED_AT_VAR, atomic_write
from ddp_hpc.environment.ports import free_port
from ddp_hpc.errors import UserError
from ddp_hpc.launch.mpi import MpiLaunch, build_mpiexec, find_program
from ddp_hpc.version import __version__

LOOPS = ("trainer", "handwritten")


@dataclass(frozen=True)
class ModelSize:
    name: str
    input_dim: int
    hidden: int
    depth: int
    batch: int
    samples: int
    optimizer: str = "sgd"

    def parameters(self, classes: int = 10) -> int:
        widths = [self.input_dim] + [self.hidden] * self.depth + [classes]
        return sum(a * b + b for a, b in zip(widths, widths[1:]))

    def state_bytes(self) -> int:
        """Parameters plus optimizer moments (Adam keeps two per parameter), fp32."""
        return self.parameters() * 4 * (3 if self.optimizer in ("adam", "adamw") else 1)

    def args(self) -> list[str]:
        return ["--input-dim", str(self.input_dim), "--hidden", str(self.hidden), "--depth", str(self.depth),
                "--batch", str(self.batch), "--samples", str(self.samples), "--optimizer", self.optimizer]


@dataclass(frozen=True)
class Plan:
    rounds: int                      # Trainer/hand-written pairs per model and world size
    epochs: int                      # timed epochs per launch, after one warm-up epoch
    compute_bound: ModelSize
    comm_bound: ModelSize
    world_sizes: tuple[int, ...]
    stall_model: ModelSize
    stall_every: int                 # steps between checkpoints in the stall runs
    startup_sizes: tuple[int, ...]
    startup_rounds: int
    bucket_sizes_mb: tuple[float, ...]  # DDP-step rows of the communication table (none: skipped)
    with_async: bool = False         # also the Trainer with checkpoint.async in the overhead pairs


# Compute-bound: a small MLP on large batches (~4.5 MFLOP per gradient byte).
# Communication-bound: a wide MLP on tiny batches (the gradient all-reduce dominates).
# Stall: an MLP whose parameters and Adam moments make a ~400 MB checkpoint (40 MB quick).
# --quick is a smoke run of every part (an acceptance test runs it): one timed epoch of 4 and 8 steps at 2
# ranks; the loops' launches were most of its time.
QUICK = Plan(rounds=2, epochs=1,
             compute_bound=ModelSize("compute-bound", 128, 256, 3, 1024, 8192),
             comm_bound=ModelSize("communication-bound", 1024, 1024, 2, 4, 64),
             world_sizes=(1, 2), stall_model=ModelSize("stall", 1024, 1024, 3, 4, 512, "adam"), stall_every=6,
             startup_sizes=(2, 4), startup_rounds=1, bucket_sizes_mb=())
FULL = Plan(rounds=4, epochs=3,
            compute_bound=ModelSize("compute-bound", 128, 256, 3, 2048, 32768),
            comm_bound=ModelSize("communication-bound", 2048, 2048, 3, 4, 128),
            world_sizes=(1, 2), stall_model=ModelSize("stall", 2048, 2048, 8, 4, 1024, "adam"), stall_every=10,
            startup_sizes=(2, 4, 8, 16), startup_rounds=3, bucket_sizes_mb=(1.0, 25.0, 100.0), with_async=True)


def machine_info() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "ddp_hpc": __version__, "backend": "gloo", "device": "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_at_start": load}


# ----- launching ------------------------------------------------------------------------

def build_torchrun(nproc: int, command: list[str]) -> list[str]:
    """torchrun on this node only, without restarts, timed against the other launchers;
    ``--no-python`` runs any executable (``ddp-hpc ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--no-python", *command]


def _launcher_argv(launcher: str, nproc: int, command: list[str]) -> list[str]:
    """torchrun itself, or the mpiexec line ``ddp-hpc launch`` builds (launch/local.py, launch/mpi.py)."""
    if launcher == "torchrun":
        return build_torchrun(nproc, command)
    return build_mpiexec(MpiLaunch(launcher, nodes=1, ranks_per_node=nproc, command=command,
                                   oversubscribe=True, allow_root=os.geteuid() == 0))


def launcher_available(launcher: str) -> bool:
    if launcher == "torchrun":
        return True
    try:
        find_program(launcher)
    except UserError:
        return False
    return True


def launch(mode: str, nproc: int, extra: list[str], workdir: Path, launcher: str = "torchrun",
           timeout: float = 600) -> dict[str, Any]:
    """One launch of the worker on ``nproc`` ranks; its rank-0 JSON result."""
    out = workdir / f"{mode}-{time.monotonic_ns()}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    port = ["--port", str(free_port())] if mode == "bare" and launcher != "torchrun" else []
    argv = _launcher_argv(launcher, nproc, [sys.executable, "-m", "ddp_hpc.bench.worker", mode, "--out", str(out),
                                            "--run-dir", str(workdir), *port, *extra])
    env[BENCH_STARTED_AT_VAR] = repr(time.time())  # "launch" for the start-up figures
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0 or not out.exists():
        raise UserError(f"benchmark launch {launcher} {mode} x{nproc} failed: "
                        f"{result.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.read_text())


# ----- overhead and scaling -------------------------------------------------------------

def measure_loops(plan: Plan, workdir: Path, progress) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Trainer and hand-written loop, alternating round by round inside one launch per model
    and world size: the overhead rows (ratio of mean step times at the largest world size,
    with every paired ratio) and the scaling rows (each loop's own efficiency)."""
    overhead, scaling = [], []
    for model in (plan.compute_bound, plan.comm_bound):
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for index, n in enumerate(plan.world_sizes):
            result = launch("loops", n, [*model.args(), "--epochs", str(plan.epochs), "--rounds", str(plan.rounds),
                                         "--first", str(index % 2), *(["--with-async"] if plan.with_async else [])],
                            workdir)
            for mode in (*LOOPS, "trainer_async"):
                runs[(mode, n)] = result.get(mode, [])
            progress(f"{model.name} x{n}: " + "  ".join(
                f"{mode} {ms_list([r['mean_step_s'] for r in result[mode]])} ms/step" for mode in result if mode != "order")
                + f"  (order {' '.join(result['order'])})")
        n = max(plan.world_sizes)
        trainer = [r["mean_step_s"] for r in runs[("trainer", n)]]
        handwritten = [r["mean_step_s"] for r in runs[("handwritten", n)]]
        paired = [t / h for t, h in zip(trainer, handwritten)]
        overhead.append({
            "model": model.name, "parameters": model.parameters(), "world_size": n,
            "steps_per_epoch": runs[("trainer", n)][0]["steps_per_epoch"], "epochs_timed": plan.epochs,
            "trainer_mean_step_s": trainer, "handwritten_mean_step_s": handwritten,
            "trainer_median_step_s": [r["median_step_s"] for r in runs[("trainer", n)]],
            "handwritten_median_step_s": [r["median_step_s"] for r in runs[("handwritten", n)]],
            "ratio_of_means": statistics.fmean(trainer) / statistics.fmean(handwritten),
            "paired_ratios": paired, "paired_ratio_spread": spread(paired), "target": 1.02})
        if runs[("trainer_async", n)]:
            with_async = [r["mean_step_s"] for r in runs[("trainer_async", n)]]
            paired_async = [t / h for t, h in zip(with_async, handwritten)]
            overhead[-1].update({"trainer_async_mean_step_s": with_async,
                                 "async_ratio_of_means": statistics.fmean(with_async) / statistics.fmean(handwritten),
                                 "async_paired_ratios": paired_async})
        base = plan.world_sizes[0]
        for mode in LOOPS:
            for size in plan.world_sizes:
                rates = [r["samples_per_s"] for r in runs[(mode, size)]]
                # Paired per round: round r's N-rank run against round r's 1-rank run.
                per_round = [rate / (size / base * one) for rate, one in
                             zip(rates, [r["samples_per_s"] for r in runs[(mode, base)]])]
                scaling.append({"model": model.name, "loop": mode, "parameters": model.parameters(),
                                "world_size": size, "samples_per_s": statistics.fmean(rates), "runs": rates,
                                "efficiency": statistics.fmean(rates) / (size / base * statistics.fmean(
                                    [r["samples_per_s"] for r in runs[(mode, base)]])),
                                "efficiency_per_round": per_round})
    return overhead, scaling


# ----- checkpoint stall -----------------------------------------------------------------

def measure_stall(plan: Plan, workdir: Path, progress) -> dict[str, Any]:
    """Time training is blocked per checkpoint at world size 2, synchronous vs asynchronous."""
    model = plan.stall_model
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    samples = 2 * model.batch * (3 * plan.stall_every + plan.stall_every // 2 + 1)
    for mode in ("sync", "async"):
        args = [*ModelSize(**{**asdict(model), "samples": samples}).args(), "--every", str(plan.stall_every),
                "--checkpoints", "3", *(["--async"] if mode == "async" else [])]
        result = launch("stall", 2, args, workdir)
        runs[mode].append(result)
        progress(f"checkpoint stall {mode}: blocked {', '.join(f'{s:.3f}' for s in result['blocked_s'])} s, "
                 f"write {', '.join(f'{s:.3f}' for s in result['write_s'])} s "
                 f"({result['checkpoint_bytes'] / 1e6:.0f} MB)")
    sync_blocked = statistics.fmean(runs["sync"][0]["blocked_s"])
    async_blocked = statistics.fmean(runs["async"][0]["blocked_s"])
    return {"model": asdict(model), "world_size": 2, "checkpoint_bytes": runs["sync"][0]["checkpoint_bytes"],
            "every_n_steps": plan.stall_every,
            "sync_blocked_s": runs["sync"][0]["blocked_s"], "async_blocked_s": runs["async"][0]["blocked_s"],
            "sync_write_s": runs["sync"][0]["write_s"], "async_write_s": runs["async"][0]["write_s"],
            "async_waited_for_previous_s": [b["waited_for_previous_s"] for b in runs["async"][0]["blocked"]],
            "async_snapshot_s": [b["snapshot_s"] for b in runs["async"][0]["blocked"]],
            "sync_mean_blocked_s": sync_blocked, "async_mean_blocked_s": async_blocked,
            "async_over_sync": async_blocked / sync_blocked, "target": 0.10}


# ----- start-up -------------------------------------------------------------------------

#: (launcher, worker mode): what runs at each size. ``handwritten`` needs torchrun's variables.
STARTUP_VARIANTS = (("torchrun", "bare"), ("torchrun", "handwritten"), ("torchrun", "trainer"),
                    ("mpich", "bare"), ("mpich", "trainer"), ("openmpi", "bare"), ("openmpi", "trainer"))
TINY = ModelSize("tiny", 16, 16, 1, 4, 0)


def measure_startup(plan: Plan, workdir: Path, progress) -> dict[str, Any]:
    """Launch to first step at every size, for bare torchrun/mpiexec (init + one all_reduce),
    the hand-written loop and ddp_hpc's Trainer; ddp_hpc's own share is the Trainer minus
    the hand-written loop (the same torch work: DDP, an optimizer, one step)."""
    rows = []
    variants = [v for v in STARTUP_VARIANTS if launcher_available(v[0])]
    missing = sorted({v[0] for v in STARTUP_VARIANTS} - {v[0] for v in variants})
    for n in plan.startup_sizes:
        tiny = ModelSize(**{**asdict(TINY), "samples": TINY.batch * n * 2})
        times: dict[tuple[str, str], list[dict[str, Any]]] = {v: [] for v in variants}
        for round_index in range(plan.startup_rounds):
            shift = (round_index + plan.startup_sizes.index(n)) % len(variants)
            for launcher, mode in variants[shift:] + variants[:shift]:
                args = [] if mode == "bare" else [*tiny.args(), "--epochs", "0", "--warmup-epochs", "1",
                                                  "--checkpoint-every-epochs", "0"]
                result = launch(mode, n, args, workdir, launcher=launcher)
                times[(launcher, mode)].append(result)
                progress(f"start-up x{n} {launcher} {mode}: {result['first_step_after_launch_s']:.2f}s")
        row: dict[str, Any] = {"world_size": n}
        for (launcher, mode), results in times.items():
            row[f"{launcher}_{mode}_s"] = [r["first_step_after_launch_s"] for r in results]
            row[f"{launcher}_{mode}_phases_s"] = [r["phases_after_launch_s"] for r in results]
        median = {key: statistics.median(values) for key, values in row.items() if key.endswith("_s")
                  and isinstance(values, list) and values and isinstance(values[0], float)}
        row["ddp_hpc_own_share_s"] = median["torchrun_trainer_s"] - median["torchrun_handwritten_s"]
        # The same difference from torch imported to the first step: without the launch and
        # the torch import, which vary by seconds between launches on an oversubscribed node.
        after_import = {mode: statistics.median(p["first_step"] - p["imported"]
                                                for p in row[f"torchrun_{mode}_phases_s"])
                        for mode in ("trainer", "handwritten")}
        row["ddp_hpc_own_share_in_process_s"] = after_import["trainer"] - after_import["handwritten"]
        for launcher in ("torchrun", "mpich", "openmpi"):
            if f"{launcher}_trainer_s" in median:
                row[f"{launcher}_trainer_minus_bare_s"] = median[f"{launcher}_trainer_s"] - median[f"{launcher}_bare_s"]
        rows.append(row)
    return {"rows": rows, "variants": [list(v) for v in variants], "launchers_missing": missing,
            "target_own_share_s": 0.2}


#: ddp_hpc's own CPU per rank before the first step (issue 21).
OWN_CPU_TARGET_S = 0.1


def measure_own_cpu(rounds: int, workdir: Path, progress, world_size: int = 2) -> dict[str, Any]:
    """ddp_hpc's own CPU per rank before the first step: rank 0's CPU seconds (every thread)
    from torch imported to the first step, the Trainer minus the hand-written loop (the same
    torch work: process group, DDP, an optimizer, one step), alternating launches."""
    tiny = ModelSize(**{**asdict(TINY), "samples": TINY.batch * world_size * 2})
    args = [*tiny.args(), "--epochs", "0", "--warmup-epochs", "1", "--checkpoint-every-epochs", "0"]
    cpu: dict[str, list[float]] = {"trainer": [], "handwritten": []}
    for round_index in range(rounds):
        for mode in (("trainer", "handwritten") if round_index % 2 == 0 else ("handwritten", "trainer")):
            result = launch(mode, world_size, args, workdir)
            cpu[mode].append(result["phases_after_launch_s"]["first_step_cpu_s"])
            progress(f"own CPU x{world_size} {mode}: {cpu[mode][-1]:.3f} s CPU after torch imported")
    pairs = [t - h for t, h in zip(cpu["trainer"], cpu["handwritten"])]
    own = statistics.median(pairs)
    return {"world_size": world_size, "launcher": "torchrun", "rounds": rounds,
            "trainer_cpu_s": cpu["trainer"], "handwritten_cpu_s": cpu["handwritten"], "paired_own_cpu_s": pairs,
            "own_cpu_s": own, "target_s": OWN_CPU_TARGET_S, "meets_target": own <= OWN_CPU_TARGET_S}


def run_own_cpu(output: Path, rounds: int = 7) -> dict[str, Any]:
    """``ddp-hpc bench own-cpu``: the figure alone, merged into ``output``'s "own_cpu" key."""
    check_output(output)
    with tempfile.TemporaryDirectory(prefix="ddp-hpc-bench-") as tmp:
        section = measure_own_cpu(rounds, Path(tmp), lambda m: print(f"bench: {m}", file=sys.stderr, flush=True))
    section.update(command="ddp-hpc bench own-cpu", machine=machine_info(), load_average_at_end=os.getloadavg())
    merge_into(output, {"own_cpu": section})
    print(f"ddp_hpc's own CPU per rank before the first step ({section['world_size']} ranks, median of "
          f"{rounds} pairs): {section['own_cpu_s']:.3f} s (target {OWN_CPU_TARGET_S} s); Trainer "
          f"{statistics.median(section['trainer_cpu_s']):.3f} s, hand-written {statistics.median(section['handwritten_cpu_s']):.3f} s")
    return section


# ----- communication --------------------------------------------------------------------

def measure_communication(plan: Plan, workdir: Path, progress) -> list[dict[str, Any]]:
    model = plan.comm_bound
    params = model.parameters()
    rows = []
    both = launch("allreduce", 2, ["--numel", str(params), "--steps", "20", "--comm-hook", "none,fp16"], workdir)
    for hook in ("none", "fp16"):
        result = both["by_hook"][hook]
        rows.append({"kind": "all_reduce of the gradients alone", "comm_hook": hook, "bucket_mb": None,
                     "mean_s": result["mean_step_s"], "median_s": result["median_step_s"],
                     "bytes_per_rank": result["bytes"]})  # a 2-rank ring sends the buffer once per rank
        progress(f"all_reduce {hook}: {result['mean_step_s'] * 1e3:.2f} ms for {result['bytes'] / 1e6:.1f} MB")
    for hook in ("none", "fp16"):
        for bucket in plan.bucket_sizes_mb:
            result = launch("trainer", 2, [*model.args(), "--epochs", str(plan.epochs), "--comm-hook", hook,
                                           "--bucket-mb", str(bucket)], workdir)
            rows.append({"kind": "DDP step (communication-bound model)", "comm_hook": hook, "bucket_mb": bucket,
                         "mean_s": result["mean_step_s"], "median_s": result["median_step_s"],
                         "bytes_per_rank": params * (2 if hook == "fp16" else 4)})
            progress(f"DDP step hook={hook} bucket={bucket}MB: {result['mean_step_s'] * 1e3:.2f} ms")
    return rows



def parse_sizes(text: str, flag: str = "--startup-sizes", smallest: int = 2) -> tuple[int, ...]:
    """``"2,4,8"`` -> (2, 4, 8): world sizes of at least ``smallest``, each once, ascending."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: give world sizes as N,N,... (e.g. 2,4,8)") from None
    if any(n < smallest for n in sizes) or list(sizes) != sorted(set(sizes)):
        raise UserError(f"{flag} {text!r}: world sizes of at least {smallest}, ascending, each once")
    return sizes


def run_bench(quick: bool, output: Path, plot_path: Path | None,
              startup_sizes: tuple[int, ...] | None = None) -> Results:
    check_output(output)
    plan = QUICK if quick else FULL
    if startup_sizes:
        plan = replace(plan, startup_sizes=startup_sizes)
    results = Results(machine_info(), {**asdict(plan), "quick": quick})

    def progress(message: str) -> None:
        print(f"bench: {message}", file=sys.stderr, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddp-hpc-bench-") as tmp:
        workdir = Path(tmp)
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_name(f".{output.name}.partial")
        # Each section is saved as it completes: a long run that fails late keeps the rest.
        results.overhead, results.scaling = measure_loops(plan, workdir, progress)
        partial.write_text(json.dumps(asdict(results), indent=2) + "\n")
        results.stall = measure_stall(plan, workdir, progress)
        partial.write_text(json.dumps(asdict(results), indent=2) + "\n")
        results.startup = measure_startup(plan, workdir, progress)
        partial.write_text(json.dumps(asdict(results), indent=2) + "\n")
        results.communication = measure_communication(plan, workdir, progress)
        partial.unlink()
    results.machine["bench_wall_s"] = round(time.monotonic() - started, 1)
    try:
        results.machine["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    merge_into(output, asdict(results))
    command = "ddp-hpc bench" + (" --quick" if quick else "") + (
        f" --startup-sizes {','.join(map(str, startup_sizes))}" if startup_sizes else "")
    markdown = markdown_path(output)
    try:
        atomic_write(markdown, format_markdown(results, command), durable=False)
    except OSError as error:
        raise UserError(f"could not write {markdown} ({error.strerror}); the results are in {output}") from None
    print(format_table(results))
    print(f"\nresults: {output} and {markdown}  ({results.machine['bench_wall_s']:.0f} s)")
    if plot_path is not None:
        if plot(results, plot_path):
            print(f"plot: {plot_path}")
        else:
            print("plot: skipped (pip install matplotlib)")
    return results

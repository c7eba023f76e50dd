"""``ddp-hpc bench``'s report of its figures: the table it prints, the markdown file beside the
JSON, the plot. The measurements are ``runner.py``'s."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_hpc.contract import atomic_write


@dataclass
class Results:
    machine: dict[str, Any]
    plan: dict[str, Any]
    overhead: list[dict[str, Any]] = field(default_factory=list)
    scaling: list[dict[str, Any]] = field(default_factory=list)
    stall: dict[str, Any] = field(default_factory=dict)
    startup: dict[str, Any] = field(default_factory=dict)
    communication: list[dict[str, Any]] = field(default_factory=list)


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "mean": statistics.fmean(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}



def ms_list(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.2f}" for v in values)


def format_table(results: Results) -> str:
    lines = ["", "== overhead (Trainer / hand-written loop, mean step time over whole epochs, alternating) =="]
    for o in results.overhead:
        s = o["paired_ratio_spread"]
        lines.append(f"{o['model']:<20} x{o['world_size']}  ratio of means {o['ratio_of_means']:.3f} "
                     f"(target <= {o['target']})  paired {', '.join(f'{r:.3f}' for r in o['paired_ratios'])}  "
                     f"[min {s['min']:.3f} max {s['max']:.3f} sd {s['stdev']:.3f}]")
        lines.append(f"{'':<20}      trainer ms/step {ms_list(o['trainer_mean_step_s'])}  hand-written "
                     f"{ms_list(o['handwritten_mean_step_s'])}")
        if "async_ratio_of_means" in o:
            lines.append(f"{'':<20}      with checkpoint.async: ratio of means {o['async_ratio_of_means']:.3f}  paired "
                         f"{', '.join(f'{r:.3f}' for r in o['async_paired_ratios'])}  ms/step "
                         f"{ms_list(o['trainer_async_mean_step_s'])}")
    lines.append("== scaling (1 thread per rank; efficiency = samples/s at N / (N x at 1), each loop its own) ==")
    for row in results.scaling:
        per_round = ", ".join(f"{e:.3f}" for e in row["efficiency_per_round"])
        lines.append(f"{row['model']:<20} {row['loop']:<11} x{row['world_size']}  {row['samples_per_s']:9.0f} "
                     f"samples/s  efficiency {row['efficiency']:.3f}  per round {per_round}")
    st = results.stall
    lines.append(f"== checkpoint stall (world size 2, {st['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, "
                 f"every {st['every_n_steps']} steps) ==")
    lines.append(f"sync:  blocked {st['sync_mean_blocked_s']:.3f} s per checkpoint ({_s(st['sync_blocked_s'])})")
    lines.append(f"async: blocked {st['async_mean_blocked_s']:.3f} s per checkpoint ({_s(st['async_blocked_s'])}), "
                 f"of which snapshot {_s(st['async_snapshot_s'])}, waiting for the previous write "
                 f"{_s(st['async_waited_for_previous_s'])}; background write {_s(st['async_write_s'])} s")
    lines.append(f"async / sync stall {st['async_over_sync']:.3f} (target <= {st['target']})")
    su = results.startup
    lines.append("== start-up (launch to first step; bare = init + one all_reduce; median s) ==")
    for row in su["rows"]:
        cells = [f"{launcher} {mode} {statistics.median(row[f'{launcher}_{mode}_s']):.2f}"
                 for launcher, mode in su.get("variants", []) if f"{launcher}_{mode}_s" in row]
        lines.append(f"x{row['world_size']:<3} " + "  ".join(cells))
        lines.append(f"     ddp_hpc own share (trainer - hand-written, torchrun) {row['ddp_hpc_own_share_s']:+.2f}s, "
                     f"from torch imported to first step {row['ddp_hpc_own_share_in_process_s']:+.2f}s "
                     f"(target <= {su['target_own_share_s']}s); trainer - bare: "
                     + "  ".join(f"{launcher} {row[f'{launcher}_trainer_minus_bare_s']:+.2f}s"
                                 for launcher in ("torchrun", "mpich", "openmpi")
                                 if f"{launcher}_trainer_minus_bare_s" in row))
    if su["launchers_missing"]:
        lines.append(f"     not measured (not installed): {', '.join(su['launchers_missing'])}")
    lines.append("== communication (communication-bound model, world size 2) ==")
    for row in results.communication:
        bucket = f"bucket {row['bucket_mb']:>5} MB" if row["bucket_mb"] else "             "
        lines.append(f"{row['kind']:<38} hook {row['comm_hook']:<4} {bucket}  {row['mean_s'] * 1e3:8.2f} ms  "
                     f"{row['bytes_per_rank'] / 1e6:6.1f} MB/rank")
    return "\n".join(lines)


def _s(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def format_markdown(results: Results, command: str) -> str:
    """The same figures as markdown tables, every paired ratio shown (docs/performance.md)."""
    m = results.machine
    out = [f"# ddp-hpc bench results ({m['date']})", "",
           f"`{command}` on {m['host']}: {m['cpus']} CPU cores, torch {m['torch']}, Python {m['python']}, "
           f"ddp_hpc {m['ddp_hpc']}, gloo, 1 thread per rank; load average at start "
           f"{_load(m.get('load_average_at_start'))}, at end {_load(m.get('load_average_at_end'))}; "
           f"{m.get('bench_wall_s', 0):.0f} s.", "",
           "## Overhead: Trainer / hand-written loop, mean step time over whole epochs", "",
           "| model | ranks | ratio of means | paired ratios (round by round) | min / max / sd | "
           "Trainer ms/step | hand-written ms/step |", "|---|---|---|---|---|---|---|"]
    for o in results.overhead:
        out.append(f"| {o['model']} | {o['world_size']} | **{o['ratio_of_means']:.3f}** | "
                   f"{', '.join(f'{r:.3f}' for r in o['paired_ratios'])} | {_spread(o['paired_ratios'])} | "
                   f"{ms_list(o['trainer_mean_step_s'])} | {ms_list(o['handwritten_mean_step_s'])} |")
        if "async_ratio_of_means" in o:
            out.append(f"| {o['model']}, `checkpoint.async` | {o['world_size']} | **{o['async_ratio_of_means']:.3f}** | "
                       f"{', '.join(f'{r:.3f}' for r in o['async_paired_ratios'])} | {_spread(o['async_paired_ratios'])} | "
                       f"{ms_list(o['trainer_async_mean_step_s'])} | |")
    out += ["", "## Scaling efficiency, both loops (samples/s at N / (N x samples/s at 1))", "",
            "| model | loop | ranks | samples/s (mean) | efficiency | per round |", "|---|---|---|---|---|---|"]
    for r in results.scaling:
        out.append(f"| {r['model']} | {r['loop']} | {r['world_size']} | {r['samples_per_s']:.0f} | "
                   f"**{r['efficiency']:.3f}** | {', '.join(f'{e:.3f}' for e in r['efficiency_per_round'])} |")
    st = results.stall
    out += ["", f"## Checkpoint stall: {st['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, 2 ranks, every "
                f"{st['every_n_steps']} steps", "",
            "| mode | blocked per checkpoint (s) | mean | background write (s) |", "|---|---|---|---|",
            f"| synchronous | {_s(st['sync_blocked_s'])} | **{st['sync_mean_blocked_s']:.3f}** | (is the stall) |",
            f"| `checkpoint.async` | {_s(st['async_blocked_s'])} (snapshot {_s(st['async_snapshot_s'])}; waiting for "
            f"the previous write {_s(st['async_waited_for_previous_s'])}) | **{st['async_mean_blocked_s']:.3f}** | "
            f"{_s(st['async_write_s'])} |", "",
            f"async / sync stall: **{st['async_over_sync']:.3f}** (target <= {st['target']})", "",
            "## Start-up: launch to first step (s; bare = init_process_group + one all_reduce)", ""]
    variants = [tuple(v) for v in results.startup.get("variants", [])
                if any(f"{v[0]}_{v[1]}_s" in r for r in results.startup["rows"])]
    out.append("| ranks | " + " | ".join(f"{launcher} {mode}" for launcher, mode in variants)
               + " | ddp_hpc own share (trainer - hand-written) | the same, torch imported to first step "
               "| trainer - bare per launcher |")
    out.append("|---" * (len(variants) + 4) + "|")
    for r in results.startup["rows"]:
        minus = ", ".join(f"{launcher} {r[f'{launcher}_trainer_minus_bare_s']:+.2f}"
                          for launcher in ("torchrun", "mpich", "openmpi") if f"{launcher}_trainer_minus_bare_s" in r)
        out.append(f"| {r['world_size']} | " + " | ".join(
            ", ".join(f"{v:.2f}" for v in r[f"{launcher}_{mode}_s"]) for launcher, mode in variants)
            + f" | {r['ddp_hpc_own_share_s']:+.2f} | **{r['ddp_hpc_own_share_in_process_s']:+.2f}** | {minus} |")
    out += ["", "Phases (s after launch, median run): imported torch, process group ready, trainer/loop ready, "
                "first step.", "", "| ranks | variant | imported | group ready | ready | first step |",
            "|---|---|---|---|---|---|"]
    for r in results.startup["rows"]:
        for launcher, mode in variants:
            phases = r[f"{launcher}_{mode}_phases_s"][0]
            out.append(f"| {r['world_size']} | {launcher} {mode} | {phases.get('imported', 0):.2f} | "
                       f"{phases.get('group_ready', 0):.2f} | {phases.get('trainer_ready', phases['first_step']):.2f} "
                       f"| {phases['first_step']:.2f} |")
    out += ["", "## Communication (communication-bound model, 2 ranks)", "",
            "| what | hook | bucket MB | mean ms | MB per rank |", "|---|---|---|---|---|"]
    for r in results.communication:
        out.append(f"| {r['kind']} | {r['comm_hook']} | {r['bucket_mb'] or ''} | {r['mean_s'] * 1e3:.2f} | "
                   f"{r['bytes_per_rank'] / 1e6:.1f} |")
    return "\n".join(out) + "\n"


def _spread(values: list[float]) -> str:
    sp = spread(values)
    return f"{sp['min']:.3f} / {sp['max']:.3f} / {sp['stdev']:.3f}"


def _load(value) -> str:
    return " / ".join(f"{v:.1f}" for v in value) if value else "n/a"


def plot(results: Results, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (scaling_ax, ratio_ax), (stall_ax, startup_ax) = axes
    for model in dict.fromkeys(r["model"] for r in results.scaling):
        for loop, style in (("trainer", "-"), ("handwritten", "--")):
            rows = [r for r in results.scaling if r["model"] == model and r["loop"] == loop]
            scaling_ax.plot([r["world_size"] for r in rows], [r["efficiency"] for r in rows], marker="o",
                            linestyle=style, label=f"{model}, {loop}")
    scaling_ax.set(xlabel="ranks", ylabel="samples/s at N / (N x at 1)", title="Scaling efficiency, both loops",
                   ylim=(0, 1.1), xticks=sorted({r["world_size"] for r in results.scaling}))
    scaling_ax.axhline(0.95, color="grey", linestyle=":")
    for index, o in enumerate(results.overhead):
        ratio_ax.scatter([index] * len(o["paired_ratios"]), o["paired_ratios"], color="C0", label="paired ratio"
                         if index == 0 else None)
        ratio_ax.scatter([index], [o["ratio_of_means"]], color="C3", marker="_", s=400,
                         label="ratio of means" if index == 0 else None)
        if "async_paired_ratios" in o:
            ratio_ax.scatter([index + 0.2] * len(o["async_paired_ratios"]), o["async_paired_ratios"], color="C2",
                             marker="x", label="paired, checkpoint.async" if index == 0 else None)
            ratio_ax.scatter([index + 0.2], [o["async_ratio_of_means"]], color="C2", marker="_", s=400)
    ratio_ax.axhline(1.02, color="grey", linestyle=":", label="target 1.02")
    ratio_ax.set(xticks=range(len(results.overhead)), xticklabels=[o["model"] for o in results.overhead],
                 ylabel="Trainer / hand-written mean step", title="Overhead: every paired ratio")
    st = results.stall
    stall_ax.bar(["sync", "async"], [st["sync_mean_blocked_s"], st["async_mean_blocked_s"]], color=["C1", "C2"])
    stall_ax.set(ylabel="s blocked per checkpoint",
                 title=f"Checkpoint stall, {st['checkpoint_bytes'] / 1e6:.0f} MB, 2 ranks")
    for key, label in (("torchrun_bare_s", "torchrun bare"), ("torchrun_handwritten_s", "torchrun hand-written"),
                       ("torchrun_trainer_s", "torchrun ddp_hpc"), ("mpich_bare_s", "MPICH bare"),
                       ("mpich_trainer_s", "MPICH ddp_hpc"), ("openmpi_bare_s", "Open MPI bare"),
                       ("openmpi_trainer_s", "Open MPI ddp_hpc")):
        rows = [r for r in results.startup["rows"] if key in r]
        if rows:
            startup_ax.plot([r["world_size"] for r in rows], [statistics.median(r[key]) for r in rows], marker="o",
                            label=label, linestyle="--" if "bare" in key else "-")
    startup_ax.set(xlabel="ranks (oversubscribed on this machine)", ylabel="s from launch to first step",
                   title="Start-up", xticks=[r["world_size"] for r in results.startup["rows"]])
    for axis in axes.flat:
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    fig.suptitle(f"ddp_hpc on {results.machine['cpus']} CPU cores, gloo, 1 thread per rank, "
                 f"{results.machine['date']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda file: fig.savefig(file, dpi=100, format=path.suffix.lstrip(".") or "png"), durable=False)
    plt.close(fig)
    return True

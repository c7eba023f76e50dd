"""Training curves of a run folder as a PNG (``curves.png``), also while the run goes on.

Epoch rows come from ``metrics.jsonl`` (train and validation, against the optimizer step),
per-step points from the csv tracker's ``tracking/metrics.csv`` when it ran.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from ddp_hpc.contract import (
    CONFIG_FILE,
    CSV_METRICS_FILE,
    CURVES_FILE,
    METRICS_FILE,
    RECORD_DIR,
    SUMMARY_FILE,
    TRACKING_DIR,
    atomic_write,
)
from ddp_hpc.errors import UserError
from ddp_hpc.tracking.csv_tracker import read_points


class MatplotlibMissing(UserError):
    """matplotlib is an optional extra."""


def _epoch_rows(run: Path) -> list[dict[str, Any]]:
    path = run / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    # A resumed run may repeat an epoch that was logged before the kill: keep the last.
    by_epoch = {row["epoch"]: row for row in rows if "epoch" in row and "step" in row}
    return [by_epoch[k] for k in sorted(by_epoch)]


def _shape(run: Path) -> tuple[int | None, int | None]:
    """(world size, effective batch) from the summary, else the newest run record."""
    summary = run / SUMMARY_FILE
    if summary.exists():
        data = json.loads(summary.read_text())
        return data.get("world_size"), data.get("effective_batch_size")
    records = sorted((run / RECORD_DIR).glob("*.json"))
    config_file = run / CONFIG_FILE
    if not records or not config_file.exists():
        return None, None
    world = len(json.loads(records[-1].read_text()).get("ranks", [])) or None
    training = (yaml.safe_load(config_file.read_text()) or {}).get("training", {})
    batch = training.get("batch_size", 0) * training.get("grad_accum_steps", 1)
    return world, batch * world if world and batch else None


def plot_run(run: Path, output: Path | None = None) -> Path:
    """Draw the curves of run folder ``run``; returns the PNG's path."""
    if not run.is_dir():
        raise UserError(f"{run} is not a run folder")
    rows = _epoch_rows(run)
    steps = [(s, k, v) for s, k, v in read_points(run / TRACKING_DIR / CSV_METRICS_FILE) if k.startswith("train/")
             and not k.startswith("train/epoch_")]
    if not rows and not steps:
        raise UserError(f"{run} has no metrics yet (metrics.jsonl is empty or missing)")
    try:
        # A Figure of its own, not pyplot: no global figure registry or interactive backend,
        # and a third less import time at the end of every run.
        from matplotlib.figure import Figure
    except ImportError:
        raise MatplotlibMissing("matplotlib is not installed: pip install matplotlib") from None

    names = sorted({k[6:] for row in rows for k in row if k.startswith("train_")}
                   | {k[4:] for row in rows for k in row if k.startswith("val_")}
                   | {k[6:] for _, k, _ in steps if k != "train/lr"})
    if "loss" in names:
        names.remove("loss")
        names.insert(0, "loss")
    has_lr = any("lr" in row for row in rows) or any(k == "train/lr" for _, k, _ in steps)
    panels = names + (["lr"] if has_lr else [])
    columns = min(3, len(panels))
    lines = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5 * columns, 3.6 * lines))
    axes = figure.subplots(lines, columns, squeeze=False)
    steps_per_epoch = rows[0]["step"] / rows[0]["epoch"] if rows and rows[0]["epoch"] else None

    for index, name in enumerate(panels):
        ax = axes[index // columns][index % columns]
        key = "train/lr" if name == "lr" else f"train/{name}"
        per_step = sorted((s, v) for s, k, v in steps if k == key)
        if per_step:
            ax.plot([s for s, _ in per_step], [v for _, v in per_step], color="tab:blue", alpha=0.35,
                    linewidth=0.8, label="train (per step, rank 0)")
        for prefix, color, label in (("train_", "tab:blue", "train (epoch)"), ("val_", "tab:orange", "validation")):
            column = "lr" if name == "lr" and prefix == "train_" else f"{prefix}{name}"
            points = [(row["step"], row[column]) for row in rows if isinstance(row.get(column), (int, float))]
            if points and not (name == "lr" and prefix == "val_"):
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3,
                        color=color, label=label)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if steps_per_epoch:
            top = ax.secondary_xaxis("top", functions=(lambda s, n=steps_per_epoch: s / n,
                                                       lambda e, n=steps_per_epoch: e * n))
            top.set_xlabel("epoch")
    for index in range(len(panels), lines * columns):
        axes[index // columns][index % columns].axis("off")
    world, batch = _shape(run)
    figure.suptitle(f"{run.name}: world size {world if world else '?'}, effective batch {batch if batch else '?'}")
    figure.tight_layout()
    output = output or run / CURVES_FILE
    atomic_write(output, lambda handle: figure.savefig(handle, format="png", dpi=110), durable=False)
    return output

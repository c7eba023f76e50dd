"""``csv``: every logged point as a ``step,name,value`` line of ``tracking/metrics.csv``."""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path

from ddp_hpc.contract import CSV_METRICS_FILE, atomic_write
from ddp_hpc.tracking.base import Held, Tracker, TrackerStart

HEADER = ["step", "name", "value"]


def read_points(path: Path) -> list[tuple[int, str, float]]:
    """The complete lines of a metrics.csv (a line cut short by a kill is ignored)."""
    if not path.exists():
        return []
    points = []
    with open(path, newline="") as handle:
        text = handle.read()
    lines = text.splitlines(keepends=True)
    for row in csv.reader(line for line in lines if line.endswith("\n")):
        if row == HEADER or len(row) != 3:
            continue
        try:
            points.append((int(row[0]), row[1], float(row[2])))
        except ValueError:
            continue
    return points


class CsvTracker(Tracker):
    name = "csv"

    def start(self, start: TrackerStart) -> tuple[str, Held]:
        stored = Path(start.run_id) if start.run_id else None
        self.path = stored if stored is not None and stored.is_file() else (start.folder / CSV_METRICS_FILE).resolve()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        held: dict[str, int] = {}
        if start.run_id is None or not self.path.exists():
            _rewrite(self.path, [])
        else:
            points = read_points(self.path)
            _rewrite(self.path, points)  # drops a last line cut short by a kill
            for step, key, _ in points:
                held[key] = max(step, held.get(key, -1))
        self.handle = open(self.path, "a", newline="")
        self.writer = csv.writer(self.handle)
        return str(self.path), Held(per_key=held)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.writerow([step, key, repr(float(value)) if math.isfinite(value) else str(value)])
        self.handle.flush()

    def flush(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self, finished: bool) -> None:
        self.handle.close()


def _rewrite(path: Path, points: list[tuple[int, str, float]]) -> None:
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(HEADER)
    for step, key, value in points:
        writer.writerow([step, key, repr(value)])
    atomic_write(path, text.getvalue(), durable=False)  # rebuilt from the lines at each start

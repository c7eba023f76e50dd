"""What the Trainer calls to feed trackers, progress lines and the run record.

Every rank calls every method (``start`` gathers each rank's environment); only rank 0
does anything else. A tracker's failure is one warning line, and training goes on.

Resuming continues each tracker's run without a gap or a repeat on the step axis: the
checkpoint stores the trackers' run ids and the per-step points logged since the previous
checkpoint (the epoch rows are in the checkpoint's history already). On resume, each
tracker says which points it already holds from the killed attempt; the points from the
checkpoint it lacks are sent again (a killed W&B loses its last few), and later points it
holds are not sent twice (exact resume makes them the same values).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddp_hpc.contract import TRACKING_DIR
from ddp_hpc.errors import UserError
from ddp_hpc.tracking import registry
from ddp_hpc.tracking.base import Held, Tracker, TrackerStart
from ddp_hpc.tracking.progress import ProgressLines, ProgressShape
from ddp_hpc.tracking.record import (MAX_GATHERED_RANKS, build_record, rank_facts, rank_files_folder, record_stamp,
                                     write_rank_facts, write_record)

if TYPE_CHECKING:
    from ddp_hpc.config import Config
    from ddp_hpc.startup.distributed import DistContext

log = logging.getLogger(__name__)

#: Per-step points a checkpoint keeps at least (more if the last checkpoint interval had more).
KEEP_POINTS = 1000

Point = tuple[int, dict[str, float]]


@dataclass(frozen=True)
class RunShape:
    world_size: int
    effective_batch_size: int
    epochs: int
    steps_per_epoch: int
    total_steps: int


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple, Mapping)):
            out[name] = json.dumps(value, sort_keys=True)
        else:
            out[name] = value
    return out


def row_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """An epoch row of metrics.jsonl as tracker metrics (``val/accuracy``, ``train/epoch_loss``)."""
    metrics: dict[str, float] = {}
    for key, value in row.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or key == "step":
            continue
        if key.startswith("train_"):
            metrics[f"train/epoch_{key[6:]}"] = float(value)
        elif key.startswith("val_"):
            metrics[f"val/{key[4:]}"] = float(value)
        elif key == "lr":
            metrics["train/epoch_lr"] = float(value)
        else:
            metrics[f"epoch/{key}" if key != "epoch" else "epoch"] = float(value)
    return metrics


def merge_by_step(points: Sequence[Point]) -> list[Point]:
    merged: dict[int, dict[str, float]] = {}
    for step, metrics in points:
        merged.setdefault(step, {}).update(metrics)
    return sorted(merged.items())


class RunningSums(Protocol):
    """An epoch's running per-sample sums (the Trainer's ``MetricSums``): tracking reads
    them, and never imports ``training/``."""

    count: Any
    sums: Mapping[str, Any]


class RunPlace(Protocol):
    """Where the run's files go (the Trainer's ``RunFolder``)."""

    @property
    def path(self) -> Path: ...


def startup_message(world_size: int, facts: dict[str, Any]) -> dict[str, Any] | None:
    """What this rank sends rank 0 at start-up: its facts in a small world, None in a large
    one (then each rank writes its own file and rank 0 learns only the node count)."""
    return facts if world_size <= MAX_GATHERED_RANKS else None


@dataclass(frozen=True)
class RecordShape:
    """How this start's record is laid out: every rank's facts in it, or one file a rank."""

    world_size: int
    rank_files: str | None
    nodes: int | None
    stamp: str | None


class Tracking:
    def __init__(self, config: Config, ctx: DistContext, run: RunPlace) -> None:
        self.config, self.ctx, self.run = config, ctx, run
        self.trackers: list[tuple[Tracker, Held]] = []
        self.run_ids: dict[str, str] = {}
        self.points: list[Point] = []
        self.lines: ProgressLines | None = None
        self._checkpoint_step = -1
        self._sums: RunningSums | None = None
        self._at_point: dict[str, tuple[float, float]] = {}
        self._at_line: dict[str, tuple[float, float]] = {}
        self._record_writer: threading.Thread | None = None

    # ----- start ------------------------------------------------------------------------

    def start(self, shape: RunShape, start_step: int, saved: Mapping[str, Any] | None,
              history: Sequence[Mapping[str, Any]], *, environ: Mapping[str, str] | None = None,
              argv: Sequence[str] | None = None) -> None:
        """Gather every rank's facts to rank 0 (a collective); there, write the run record in
        the background and start the trackers."""
        ctx = self.ctx
        facts = rank_facts(ctx.env.to_dict(), str(ctx.device.torch_device), ctx.device.backend,
                           os.environ if environ is None else environ)
        sent = startup_message(ctx.world_size, facts)
        rank_files, nodes, stamp = None, None, None
        if sent is not None:
            gathered = ctx.gather_object(sent)
        else:
            # A large world: each rank's facts go to its own file; rank 0 learns the node count.
            stamp = ctx.broadcast_object(record_stamp() if ctx.is_rank_zero else "")
            rank_files = rank_files_folder(stamp, start_step)
            try:
                write_rank_facts(self.run.path, rank_files, facts)
            except OSError as exc:
                log.warning("could not write this rank's facts to %s: %s", rank_files, exc)
            nodes = round(ctx.all_reduce([1.0 if ctx.local_rank == 0 else 0.0])[0])
            gathered = [facts]
        if not ctx.is_rank_zero:
            return
        # Launchers name a dead process by host and PID (MPICH) or by rank (torchrun, srun):
        # this line maps one to the other in the job log.
        if rank_files is None:
            log.info("ranks (host:pid): %s",
                     " ".join(f"{rank}={fact['host']}:{fact['pid']}" for rank, fact in enumerate(gathered)))
        else:
            log.info("ranks (host:pid): %d ranks on %d nodes, one file a rank in %s", ctx.world_size, nodes,
                     self.run.path / rank_files)
        # Versions, packages and git state take ~0.15 s (subprocesses, a scan of every
        # installed distribution): not worth delaying the first step for.
        self._record_writer = threading.Thread(
            target=self._write_record, name="ddp-hpc-run-record", daemon=True,
            args=(sys.argv if argv is None else list(argv), gathered, start_step, Path.cwd(),
                  RecordShape(ctx.world_size, rank_files, nodes, stamp)))
        self._record_writer.start()

        logging_config = self.config.logging
        params = {**flatten(self.config.to_dict()), "world_size": shape.world_size,
                  "effective_batch_size": shape.effective_batch_size}
        saved_runs = dict(saved.get("runs", {})) if saved else {}
        replay = merge_by_step([*[(int(s), dict(m)) for s, m in (saved or {}).get("points", [])],
                                *[(int(row["step"]), row_metrics(row)) for row in history]])
        self.points = [(s, dict(m)) for s, m in (saved or {}).get("points", [])]
        self._checkpoint_step = start_step
        for name in logging_config.trackers:
            tracker = registry.create(name, logging_config)
            start = TrackerStart(run_name=self.run.path.name, folder=self.run.path / TRACKING_DIR,
                                 run_id=saved_runs.get(name), resume_step=start_step, params=params)
            try:
                run_id, held = tracker.start(start)
            except Exception as exc:  # noqa: BLE001 - any tracker error: warn, train on
                log.warning("tracker %s did not start, training goes on without it: %s: %s", name,
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                continue
            self.run_ids[name] = run_id
            self.trackers.append((tracker, held))
            log.info("tracker %s: %s run %s", name, "continuing" if start.run_id else "new", run_id)
            for step, metrics in replay:
                self._send_one(tracker, held, step, metrics)

        if logging_config.progress_every_s > 0 and not self.progress_bar_shown():
            self.lines = ProgressLines(
                ProgressShape(shape.epochs, shape.steps_per_epoch, shape.total_steps,
                              shape.effective_batch_size), logging_config.progress_every_s, start_step)

    def _write_record(self, argv: Sequence[str], ranks: Sequence[dict[str, Any]], start_step: int,
                      cwd: Path, shape: RecordShape) -> None:
        try:
            record = build_record(run_path=self.run.path, argv=argv, config=self.config.to_dict(), ranks=ranks,
                                  start_step=start_step, cwd=cwd, world_size=shape.world_size,
                                  rank_files=shape.rank_files, nodes=shape.nodes)
            log.info("run record: %s", write_record(self.run.path, record, shape.stamp))
        except Exception as exc:  # noqa: BLE001 - a record is worth a warning, not the run
            log.warning("could not write the run record: %s: %s", type(exc).__name__, exc)

    def wait_for_record(self) -> None:
        """The run record is on disk (or its failure logged) when this returns."""
        if self._record_writer is not None:
            self._record_writer.join()
            self._record_writer = None

    def progress_bar_shown(self) -> bool:
        mode = self.config.logging.progress
        return mode == "always" or (mode == "auto" and sys.stderr.isatty())

    # ----- logging ----------------------------------------------------------------------

    def _send_one(self, tracker: Tracker, held: Held, step: int, metrics: Mapping[str, float]) -> None:
        fresh = {k: v for k, v in metrics.items() if not held.holds(k, step)}
        if not fresh:
            return
        try:
            tracker.log_metrics(step, fresh)
        except Exception as exc:  # noqa: BLE001
            self._drop(tracker, "failed to log", exc)

    def _send(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker, held in list(self.trackers):
            self._send_one(tracker, held, step, metrics)

    def _drop(self, tracker: Tracker, what: str, exc: Exception) -> None:
        log.warning("tracker %s %s, training goes on without it: %s: %s", tracker.name, what,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        self.trackers = [(t, h) for t, h in self.trackers if t is not tracker]

    def _interval_means(self, sums: RunningSums, since: dict[str, tuple[float, float]]) -> dict[str, float]:
        """Rank 0's per-sample means since the previous call with the same ``since``."""
        if sums is not self._sums:  # a new epoch: its sums start at zero
            self._sums = sums
            self._at_point.clear()
            self._at_line.clear()
        count = float(sums.count)
        means = {}
        for key, total in sums.sums.items():
            value = float(total)
            before_value, before_count = since.get(key, (0.0, 0.0))
            if count > before_count:
                means[key] = (value - before_value) / (count - before_count)
            since[key] = (value, count)
        return means

    def on_step(self, epoch: int, global_step: int, sums: RunningSums, lr: float) -> None:
        if not self.ctx.is_rank_zero:
            return
        every = self.config.logging.log_every_n_steps
        if self.trackers and every and global_step % every == 0:
            metrics = {f"train/{k}": v for k, v in self._interval_means(sums, self._at_point).items()}
            metrics["train/lr"] = float(lr)
            self.points.append((global_step, metrics))
            self._send(global_step, metrics)
        if self.lines is not None and self.lines.due():
            loss = self._interval_means(sums, self._at_line).get("loss")
            log.info(self.lines.line(epoch, global_step, loss))

    def on_epoch(self, row: Mapping[str, Any]) -> None:
        if self.ctx.is_rank_zero and self.trackers:
            self._send(int(row["step"]), row_metrics(row))

    def on_test(self, global_step: int, metrics: Mapping[str, float]) -> None:
        if self.ctx.is_rank_zero and self.trackers:
            self._send(global_step, {f"test/{k}": float(v) for k, v in metrics.items()})

    # ----- checkpoints and the end -------------------------------------------------------

    def state(self, global_step: int) -> dict[str, Any]:
        """For the checkpoint (rank 0): run ids and recent points, after a flush."""
        self.wait_for_record()  # a checkpoint's run has its record
        for tracker, _ in list(self.trackers):
            try:
                tracker.flush()
            except Exception as exc:  # noqa: BLE001
                self._drop(tracker, "failed to flush", exc)
        recent = sum(1 for step, _ in self.points if step > self._checkpoint_step)
        self.points = self.points[-max(recent, KEEP_POINTS):]
        self._checkpoint_step = global_step
        return {"runs": dict(self.run_ids), "points": [[step, dict(m)] for step, m in self.points]}

    def finish(self, completed: bool) -> None:
        """Close the trackers (a preempted run's stay open for the requeued job) and plot."""
        if not self.ctx.is_rank_zero:
            return
        self.wait_for_record()
        for tracker, _ in self.trackers:
            try:
                tracker.close(finished=completed)
            except Exception as exc:  # noqa: BLE001
                log.warning("tracker %s did not close cleanly: %s: %s", tracker.name, type(exc).__name__, exc)
        self.trackers = []
        if completed and self.config.logging.plot:
            from ddp_hpc.tracking.plot import MatplotlibMissing, plot_run

            try:
                log.info("training curves: %s", plot_run(self.run.path))
            except MatplotlibMissing:
                log.info("matplotlib is not installed: no training curves (pip install matplotlib)")
            except UserError as exc:
                log.info("no training curves: %s", exc)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not plot the training curves: %s: %s", type(exc).__name__, exc)

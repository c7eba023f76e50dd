"""Progress lines for logs that are not a terminal (a batch job's ``logs/*.out``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressShape:
    epochs: int
    steps_per_epoch: int
    #: Optimizer steps of the whole run (``training.max_steps`` counted in).
    total_steps: int
    #: Samples per optimizer step over all ranks.
    samples_per_step: int


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class ProgressLines:
    """Says where training stands every ``every_s`` seconds (checked at each step)."""

    def __init__(self, shape: ProgressShape, every_s: float, start_step: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shape, self.every_s, self.clock = shape, every_s, clock
        self._last_time, self._last_step = clock(), start_step

    def due(self) -> bool:
        return self.clock() - self._last_time >= self.every_s

    def line(self, epoch: int, global_step: int, loss: float | None) -> str:
        """The line for ``global_step`` (steps since the previous line give the rate)."""
        now = self.clock()
        elapsed, steps = now - self._last_time, global_step - self._last_step
        self._last_time, self._last_step = now, global_step
        shape = self.shape
        in_epoch = global_step - epoch * shape.steps_per_epoch
        rate = steps / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            eta_epoch = format_duration((shape.steps_per_epoch - in_epoch) / rate)
            eta_run = format_duration((shape.total_steps - global_step) / rate)
        else:
            eta_epoch = eta_run = "?"
        loss_text = f"  loss {loss:.4f}" if loss is not None else ""
        return (f"epoch {epoch + 1}/{shape.epochs}  step {in_epoch}/{shape.steps_per_epoch} "
                f"(run {global_step}/{shape.total_steps})  {rate * shape.samples_per_step:.0f} samples/s"
                f"{loss_text}  ETA epoch {eta_epoch}, run {eta_run}")

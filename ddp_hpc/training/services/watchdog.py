"""``distributed.watchdog_s``: the engine's ``watchdog()`` around training, beaten at every
step, evaluation batch and checkpoint; rank 0 keeps the stragglers it names in the run
folder (``record/stragglers.json``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING

from ddp_hpc.engine.liveness import Straggler, watchdog
from ddp_hpc.engine.watchdog import Watchdog
from ddp_hpc.training.callbacks import Callback
from ddp_hpc.training.run_folder import RunFolder

if TYPE_CHECKING:
    from ddp_hpc.training.trainer import Trainer


class WatchdogService(Callback):
    """Watched from the first step on: set-up (datasets, resume) may take long legitimately.
    The heartbeat that names silent ranks, ranks out of step and stragglers uses the
    group's rendezvous store."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.dog: Watchdog | None = None
        #: Rank 0: the stragglers its heartbeat named, by rank (kept in the run record).
        self.stragglers: dict[int, Straggler] = {}

    @contextmanager
    def running(self, trainer: Trainer) -> Iterator[None]:
        env, ctx = trainer.ctx.env, trainer.ctx
        store = (env.master_addr, env.master_port) if ctx.group_initialized and ctx.world_size > 1 else None
        straggling = (lambda found: self._record(trainer.run, found)) if ctx.is_rank_zero else None
        with watchdog(self.limit_s, heartbeat_store=store, on_straggler=straggling,
                      limit_name="distributed.watchdog_s") as self.dog:
            try:
                yield
            finally:
                self.dog = None

    def _record(self, run: RunFolder, straggler: Straggler) -> None:
        """Rank 0's heartbeat thread: keep what it found in the run record."""
        self.stragglers[straggler.rank] = straggler
        run.write_stragglers([asdict(found) for found in self.stragglers.values()])

    def on_progress(self, trainer: Trainer, phase: str) -> None:
        if self.dog is not None:
            compute_s = trainer.loop.step_compute_s if phase == "training" else None
            self.dog.beat(phase, trainer.progress.global_step, compute_s)

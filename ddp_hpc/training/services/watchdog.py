"""``distributed.watchdog_s``: the engine's ``watchdog()`` around training, beaten at every
step, evaluation batch and checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ddp_hpc.engine.liveness import watchdog
from ddp_hpc.engine.watchdog import Watchdog
from ddp_hpc.training.callbacks import Callback

if TYPE_CHECKING:
    from ddp_hpc.training.trainer import Trainer


class WatchdogService(Callback):
    """Watched from the first step on: set-up (datasets, resume) may take long legitimately.
    The heartbeat that names silent ranks uses the group's rendezvous store."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.dog: Watchdog | None = None

    @contextmanager
    def running(self, trainer: Trainer) -> Iterator[None]:
        env, ctx = trainer.ctx.env, trainer.ctx
        store = (env.master_addr, env.master_port) if ctx.group_initialized and ctx.world_size > 1 else None
        with watchdog(self.limit_s, heartbeat_store=store, limit_name="distributed.watchdog_s") as self.dog:
            try:
                yield
            finally:
                self.dog = None

    def on_progress(self, trainer: Trainer, phase: str) -> None:
        if self.dog is not None:
            self.dog.beat(phase, trainer.progress.global_step)

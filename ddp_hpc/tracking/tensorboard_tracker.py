"""``tensorboard``: torch's SummaryWriter in ``tracking/tensorboard``, one folder per run."""

from __future__ import annotations

import json
from pathlib import Path

from ddp_hpc.tracking.base import Held, Tracker, TrackerStart


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def start(self, start: TrackerStart) -> tuple[str, Held]:
        from torch.utils.tensorboard import SummaryWriter

        # The folder of the run being continued: a chained job in a new run folder keeps
        # writing to it while it exists.
        stored = Path(start.run_id) if start.run_id else None
        folder = stored if stored is not None and stored.is_dir() else (start.folder / "tensorboard").resolve()
        earlier = folder.exists() and any(folder.glob("events.out.tfevents.*"))
        # purge_step: TensorBoard hides the events of earlier attempts from this step on, so
        # steps logged after the checkpoint by a killed attempt are not shown twice. A fresh
        # run in a folder that has events hides them all.
        purge = (start.resume_step + 1 if start.run_id else 0) if earlier else None
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge, flush_secs=30)
        if start.run_id is None:
            text = "\n".join(f"    {k}: {json.dumps(v)}" for k, v in sorted(start.params.items()))
            self.writer.add_text("hyperparameters", text, 0)
        # Everything up to the checkpoint's step was flushed before the checkpoint was written.
        return str(folder), Held(upto=start.resume_step if start.run_id else -1)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()

"""``wandb``: Weights & Biases, offline by default (``wandb sync`` uploads it later).

Each attempt of an offline run is a folder ``tracking/wandb/offline-run-<time>-<id>``
with the same run id, which ``wandb sync`` joins into the one run.
"""

from __future__ import annotations

import uuid

from ddp_hpc.tracking import wandb_log
from ddp_hpc.tracking.base import Held, Tracker, TrackerStart


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, project: str | None, entity: str | None, mode: str) -> None:
        self.project, self.entity, self.mode = project, entity, mode

    def start(self, start: TrackerStart) -> tuple[str, Held]:
        import wandb

        start.folder.mkdir(parents=True, exist_ok=True)
        run_id = start.run_id or uuid.uuid4().hex[:12]
        held: dict[str, int] = {}
        if start.run_id and self.mode == "offline":
            for path in wandb_log.offline_run_files(start.folder, run_id):
                for step, row in wandb_log.history(path):
                    for key in row:
                        held[key] = max(step, held.get(key, -1))
        settings = wandb.Settings(mode=self.mode, console="off", silent=True, x_disable_stats=True,
                                  disable_git=True, save_code=False)
        self.run = wandb.init(project=self.project or "ddp_hpc", entity=self.entity, name=start.run_name,
                              id=run_id, resume="allow", dir=str(start.folder), config=start.params,
                              settings=settings, reinit="create_new")
        upto = self.run.starting_step - 1 if self.mode == "online" and start.run_id else -1
        return run_id, Held(upto=upto, per_key=held)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, finished: bool) -> None:
        if not finished:
            self.run.mark_preempting()  # the requeued job resumes this run
        self.run.finish()

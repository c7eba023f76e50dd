"""``mlflow``: one MLflow run, through ``MlflowClient`` (no global active run).

MLflow 3 refuses its ``./mlruns`` file store unless MLFLOW_ALLOW_FILE_STORE is set; the
local store it supports is SQLite, so the default tracking URI is a database in the run
folder (``tracking/mlflow.db``).
"""

from __future__ import annotations

import time
from pathlib import Path

from ddp_hpc.tracking.base import Held, Tracker, TrackerStart


def default_tracking_uri(folder: Path) -> str:
    return f"sqlite:///{folder.resolve() / 'mlflow.db'}"


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, tracking_uri: str | None, experiment: str | None) -> None:
        self.tracking_uri, self.experiment = tracking_uri, experiment

    def start(self, start: TrackerStart) -> tuple[str, Held]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        start.folder.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri or default_tracking_uri(start.folder))
        held: dict[str, int] = {}
        if start.run_id:
            run = self.client.get_run(start.run_id)
            for key in run.data.metrics:
                steps = [m.step for m in self.client.get_metric_history(start.run_id, key)]
                held[key] = max(steps, default=-1)
            self.client.update_run(start.run_id, status="RUNNING")
            self.run_id = start.run_id
            return self.run_id, Held(per_key=held)
        name = self.experiment or start.run_name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment else self.client.create_experiment(
            name, artifact_location=(start.folder / "mlflow-artifacts").resolve().as_uri()))
        self.run_id = self.client.create_run(experiment_id, run_name=start.run_name).info.run_id
        # MLflow caps a parameter value at 6000 characters.
        params = [Param(k, str(v)[:6000]) for k, v in sorted(start.params.items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        return self.run_id, Held()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def close(self, finished: bool) -> None:
        # A preempted run stays RUNNING: the requeued job continues it.
        if finished:
            self.client.set_terminated(self.run_id, status="FINISHED")

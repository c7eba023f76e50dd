"""A job's record in its run folder (``submission.json``, ``submissions.jsonl``): written by
whatever started the job (a scheduler backend's submit, or ``ddp-hpc launch --hostfile``,
which records itself as a ``local`` job), read by ``status``, ``logs`` and ``cancel``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ddp_hpc.contract.atomic import atomic_write
from ddp_hpc.contract.run_files import SUBMISSION_FILE, SUBMISSIONS_LOG, exit_file_name

#: The scheduler name of a job that ``ddp-hpc launch`` started on this machine (the ``local`` family's).
LOCAL_SCHEDULER = "local"


@dataclass(frozen=True)
class ElementRecord:
    """One element of a sweep (an array job's task): its id, run folder and overrides."""

    index: int
    job_id: str
    run_folder: str
    assignment: str

    @property
    def exit_file(self) -> Path:
        return Path(self.run_folder) / exit_file_name(self.job_id)


@dataclass(frozen=True)
class Submission:
    """A submitted job, recorded in its run folder so that ``status``, ``logs`` and
    ``cancel`` work from the folder alone."""

    scheduler: str
    job_id: str
    run_folder: str
    workdir: str
    world_size: int
    submitted_at: float
    kind: str
    script: str | None = None
    logs: tuple[str, ...] = ()
    command_line: tuple[str, ...] = ()
    #: Every link of a chain, first to last (``job_id`` is the last).
    chain: tuple[str, ...] = ()
    #: A sweep's elements (``job_id`` is the array job's).
    elements: tuple[ElementRecord, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Submission:
        data = json.loads(text)
        for name in ("logs", "command_line", "chain"):
            data[name] = tuple(data.get(name, ()))
        data["elements"] = tuple(ElementRecord(**e) for e in data.get("elements", ()))
        return cls(**data)

    def record(self) -> Path:
        """Write ``submission.json`` (the newest) and append to ``submissions.jsonl``."""
        folder = Path(self.run_folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / SUBMISSION_FILE
        atomic_write(path, self.to_json(), durable=True)
        with open(folder / SUBMISSIONS_LOG, "a") as handle:
            handle.write(json.dumps(asdict(self), sort_keys=True) + "\n")
        return path

    @property
    def exit_file(self) -> Path:
        """Written by the rendered script when the job ends (``ddp-hpc launch``'s ``restart.record_exit``)."""
        return Path(self.run_folder) / exit_file_name(self.job_id)

    @property
    def location(self) -> str:
        """Where to look first: the submitted script, else the folder of the job's output."""
        if self.script:
            return f"script {self.script}"
        return f"logs in {Path(self.logs[0]).parent}" if self.logs else f"run folder {self.run_folder}"


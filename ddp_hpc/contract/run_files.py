"""The names of the files and folders in a run folder, shared by the ranks that write them
and the launch side that reads them (``status``, the rendered scripts)."""

from __future__ import annotations

import re
from pathlib import Path

from ddp_hpc.contract.atomic import atomic_write


#: The resolved config, as training ran it.
CONFIG_FILE = "config.yaml"
#: One JSON line per epoch.
METRICS_FILE = "metrics.jsonl"
#: The run's result (``RunSummary``).
SUMMARY_FILE = "summary.json"
#: Checkpoints: ``step-NNNNNNNN.pt`` files, ``last.pt`` and ``best.pt`` pointing at one of them.
CHECKPOINTS_DIR = "checkpoints"
LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
#: Sharded checkpoints (``checkpoint.format: dcp``): ``step-NNNNNNNN/`` folders, and these
#: one-line files naming the newest complete one and the best one.
LAST_SHARDED_CHECKPOINT = "last.dcp"
BEST_SHARDED_CHECKPOINT = "best.dcp"
#: A sharded checkpoint's step folder, and the file written last in it (complete once it exists).
SHARDED_STEP_FOLDER = re.compile(r"^step-(\d{8})$")
SHARDED_METADATA_FILE = ".metadata"


def checkpoint_format_of(path: Path) -> str | None:
    """``file`` or ``dcp``: the format of the checkpoint at ``path`` as a user names it (a
    ``.pt`` file; a step folder, a file in one, ``last.dcp``/``best.dcp``, or any folder
    holding the sharded metadata); None when neither its name nor its contents say."""
    if path.suffix == ".pt":
        return "file"
    if path.suffix == ".dcp" or SHARDED_STEP_FOLDER.match(path.name) or SHARDED_STEP_FOLDER.match(path.parent.name):
        return "dcp"
    if path.is_dir() and (path / SHARDED_METADATA_FILE).exists():
        return "dcp"
    return None
#: Run records (``<UTC stamp>-step<N>.json``): who ran what, where, with which versions.
RECORD_DIR = "record"
#: In the record folder: the stragglers rank 0 named (a JSON list; rewritten as it names more).
STRAGGLERS_FILE = "stragglers.json"
#: What trackers write in the run folder; the CSV tracker's file inside it.
TRACKING_DIR = "tracking"
CSV_METRICS_FILE = "metrics.csv"
#: Training curves drawn from the metrics.
CURVES_FILE = "curves.png"
#: Each rank's log file (``rank-00003.log``), appended by every attempt.
RANK_LOG_DIR = "logs"
#: Written by rank 0 (``StopAgreement``) when the ranks stopped after a checkpoint: a batch
#: script whose ranks' REQUEUE reached it as SIGTERM (``srun --kill-on-bad-exit``) reads it.
#: ``mark_stopped`` is its one writer.
PREEMPTED_MARKER = "preempted"
#: The newest submission of the run, and every one of them (one JSON line each).
SUBMISSION_FILE = "submission.json"
SUBMISSIONS_LOG = "submissions.jsonl"
#: What a rendered script writes when the job ends: its exit status, for ``status``/``--wait``.
EXIT_FILE_PREFIX = "exit-"
#: The nodes a batch script left out of a restart (``--spare-nodes``), one JSON line each:
#: ``{"host": ..., "attempt": N, "reason": ...}``; ``ddp-hpc status`` shows them.
LEFT_OUT_FILE = "left-out-hosts.jsonl"
#: ``.restarted-<job>``: made (O_EXCL) by the first task of a failed submitit job that
#: submits it again, so that the job is submitted again once.
RESTARTED_MARKER_PREFIX = ".restarted-"
#: ``rank-failures-<attempt>``: one line ``RANK STATUS`` per rank that failed in that attempt,
#: in the order they failed (the first names the node a PBS restart leaves out).
RANK_FAILURES_PREFIX = "rank-failures-"
#: The hidden temporaries of :func:`atomic_write` (``.NAME.tmp-...``): a crash may leave one.
TEMPORARY_GLOB = ".*.tmp-*"


def exit_file_name(job_id: str) -> str:
    """``exit-<job id>`` (``exit-123_4`` for an array element)."""
    return f"{EXIT_FILE_PREFIX}{job_id}"


def mark_stopped(marker: Path) -> None:
    """Leave the ``preempted`` marker (``RUN/preempted``, or the path a ``StopAgreement`` was
    given): the ranks stopped after a checkpoint. The one writer: rank 0's ``StopAgreement``,
    and the rank wrapper under mpiexec through ``ddp-hpc record-stop`` (``launch/script.py``)."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(marker, b"", durable=False)

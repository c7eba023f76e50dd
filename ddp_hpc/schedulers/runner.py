"""Submitting a request and following the job to its end, over any backend of the registry:
``dry_run`` (what would be submitted, as data), ``submit``, ``wait`` (poll, then gather how
the job ended: ``JobResult``), ``read_submission`` (the record in a run folder)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import SUBMISSION_FILE, SUMMARY_FILE
from ddp_hpc.errors import UserError
from ddp_hpc.schedulers.base import DryRun, ElementRecord, JobState, JobStatus, Scheduler, Submission
from ddp_hpc.schedulers.registry import check_profile_family, get_scheduler, scheduler_for
from ddp_hpc.specs.request import SubmitRequest
from ddp_hpc.summary import RunSummary


def dry_run(request: SubmitRequest, scheduler: str | None = None, *, workdir: Path | None = None,
            script_path: Path | None = None) -> DryRun:
    """What submitting would do, as data (the script, the submit command, the per-rank command)."""
    check_profile_family(request.profile)
    backend = get_scheduler(scheduler) if scheduler else scheduler_for(request.profile.scheduler)
    return backend.dry_run(request, (workdir or Path.cwd()).resolve(), script_path)


def submit(request: SubmitRequest, scheduler: str | None = None, *, workdir: Path | None = None,
           script_path: Path | None = None) -> Submission:
    """Submit ``request`` (to ``scheduler``, default: the profile's default backend) and
    record the submission in the run folder. ``wait`` follows it to the end."""
    plan = dry_run(request, scheduler, workdir=workdir, script_path=script_path)
    return get_scheduler(plan.scheduler).submit(plan)


@dataclass(frozen=True)
class ElementResult:
    """How one sweep element ended."""

    element: ElementRecord
    status: JobStatus
    summary: RunSummary | None

    def succeeded(self, kind: str) -> bool:
        if kind == "train":
            return self.summary is not None and not self.summary.preempted
        return self.status.state is JobState.COMPLETED and not self.status.exit_code


@dataclass(frozen=True)
class JobResult:
    """How a job ended: its state, exit status, training summary (config jobs), log tail,
    and for a sweep each element's."""

    submission: Submission
    status: JobStatus
    summary: RunSummary | None
    failure: str | None
    log_tail: str
    elements: tuple[ElementResult, ...] = ()

    @property
    def succeeded(self) -> bool:
        if self.elements:
            return all(e.succeeded(self.submission.kind) for e in self.elements)
        if self.submission.kind == "train":
            return self.summary is not None and self.failure is None and not self.summary.preempted
        return self.status.state is JobState.COMPLETED and not self.status.exit_code

    @property
    def exit_code(self) -> int:
        """What ``submit --wait`` exits with: 0; for a failed command job its own status where
        known; else 1 (a training job that left no summary)."""
        if self.succeeded:
            return 0
        if self.submission.kind == "command" and self.status.exit_code:
            return self.status.exit_code
        return 1


def read_submission(target: str | Path) -> Submission:
    """The newest submission recorded in a run folder (or its ``submission.json``)."""
    path = Path(target)
    path = path / SUBMISSION_FILE if path.is_dir() else path
    try:
        return Submission.from_json(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no submission recorded at {path}: submit with 'ddp-hpc submit' first") from None
    except (ValueError, TypeError) as exc:
        raise UserError(f"{path} is not a ddp_hpc submission record ({exc})") from None


def log_tail(scheduler: Scheduler, submission: Submission, lines: int = 20, files: int = 4) -> str:
    """The last lines of the job's first few non-empty output files (rank 0's first)."""
    parts = []
    for path in [p for p in scheduler.log_files(submission) if p.stat().st_size][:files]:
        text = path.read_text(errors="replace").splitlines()
        if text:
            parts.append(f"{path}:\n" + "\n".join(text[-lines:]))
    return "\n".join(parts) or "(no job output file found)"


def wait(submission: Submission, *, poll_s: float = 2.0, timeout_s: float | None = None,
         confirmations: int = 3) -> JobResult:
    """Poll until the job is over, then gather how it ended.

    A requeue passes through a terminal-looking state for a moment (the step ended, the job
    is not yet pending again), so the end must be seen on ``confirmations`` polls in a row.
    A status source that fails now and then (an overloaded slurmctld) only costs a poll.
    """
    scheduler = get_scheduler(submission.scheduler)
    started = time.monotonic()
    seen_done = 0
    while True:
        submission = _resubmitted(submission)
        status = scheduler.status(submission)
        seen_done = seen_done + 1 if status.state.is_terminal else 0
        if seen_done >= confirmations:
            break
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise UserError(f"job {submission.job_id} still {status.state.value} after {timeout_s:.0f}s")
        time.sleep(poll_s)
    return job_result(scheduler, submission, status)


def _resubmitted(submission: Submission) -> Submission:
    """The run folder's record of this submission, when the job submitted itself again (a
    submitit command job's ``--max-restarts``) and the record names the new job."""
    try:
        recorded = read_submission(Path(submission.run_folder))
    except (UserError, OSError, ValueError, TypeError):
        return submission
    same = recorded.submitted_at == submission.submitted_at and recorded.scheduler == submission.scheduler
    return recorded if same and submission.job_id in recorded.chain else submission


def read_summary(run_folder: str | Path, since: float) -> RunSummary | None:
    """The run's summary, if written by this submission (not an earlier run's)."""
    path = Path(run_folder) / SUMMARY_FILE
    if path.exists() and path.stat().st_mtime >= since - 1:
        return RunSummary.read(path)
    return None


def job_result(scheduler: Scheduler, submission: Submission, status: JobStatus) -> JobResult:
    elements = tuple(
        ElementResult(element, element_status, read_summary(element.run_folder, submission.submitted_at))
        for element, element_status in zip(submission.elements, scheduler.element_statuses(submission)))
    summary = read_summary(submission.run_folder, submission.submitted_at) if submission.kind == "train" else None
    failure = scheduler.failure(submission) if status.state is not JobState.COMPLETED else None
    return JobResult(submission, status, summary, failure, log_tail(scheduler, submission), elements)

"""Schedulers: one package per family, both sides of the job in it (render the script,
submit, read the job's state, cancel, and what runs inside the job): ``pbs/``, ``slurm/``,
``local/`` (the smallest example). ``base.py`` is the interface every backend fills in,
``registry.py`` the families (each package's ``FAMILY``, found through the ``ddp_hpc.schedulers``
entry points) and their backends, ``runner.py`` submits and follows a
job over any of them, ``commands.py`` the scheduler verbs of the CLI (``render``, ``submit``,
``status``, ``logs``, ``cancel``, ``port``).

This ``__init__`` only re-exports: ``from ddp_hpc.schedulers import submit, wait, dry_run``.
"""

from ddp_hpc.schedulers.base import DryRun, JobState, JobStatus, RunOpt, Scheduler, SchedulerFamily, Submission
from ddp_hpc.schedulers.registry import (
    REGISTRY,
    backend_for,
    backends,
    default_profile,
    families,
    get_scheduler,
    run_opts,
    scheduler_families,
    scheduler_for,
)
from ddp_hpc.schedulers.runner import ElementResult, JobResult, dry_run, read_submission, submit, wait

__all__ = ["REGISTRY", "DryRun", "ElementResult", "JobResult", "JobState", "JobStatus", "RunOpt", "Scheduler",
           "SchedulerFamily", "Submission", "backend_for", "backends", "default_profile", "dry_run", "families",
           "get_scheduler", "read_submission", "run_opts", "scheduler_families", "scheduler_for", "submit", "wait"]

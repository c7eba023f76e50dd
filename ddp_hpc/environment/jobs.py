"""What a scheduler tells the processes of its job: one ``SchedulerJob`` per scheduler family.

Where submitit keeps one ``JobEnvironment`` per scheduler, this is the rank side's view of a
family: the job id, the job's nodes, when the allocation ends, and how the job asks to be
queued again. The launch and the ranks ask the job they run in (``current_job``) instead of
scanning lists of variables; the family's submitting side (``schedulers/<family>/``) names the
same object as its ``job``.

A site's scheduler adds its own through the entry points of the group ``ddp_hpc.jobs``
(pyproject.toml of the site's package)::

    [project.entry-points."ddp_hpc.jobs"]
    lsf = "my_site.lsf:LsfJob"

Built-in jobs are asked first (SLURM before PBS: Slurm's PBS wrappers set both, and
``SLURM_JOB_ID`` is the id sacct, scontrol and scancel know), then the site's.
"""

from __future__ import annotations

import logging
from abc import ABC
from collections.abc import Iterator, Mapping
from functools import lru_cache

from ddp_hpc.environment.hosts import expand_nodelist, read_nodefile
from ddp_hpc.environment.site_entries import site_objects
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

Env = Mapping[str, str]

GROUP = "ddp_hpc.jobs"


def _first(env: Env, names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


class SchedulerJob(ABC):
    """One scheduler family's job, as its processes see it. Subclasses set the variables;
    ``hosts`` is the one method a scheduler with another node-list form overrides."""

    #: The family's name (``slurm``, ``pbs``; a site's own).
    name: str = ""
    #: Where the job id is read, first found wins.
    job_id_variables: tuple[str, ...] = ()
    #: Where the allocation's end is read (epoch seconds), first found wins; () where none is set.
    end_time_variables: tuple[str, ...] = ()
    #: The command that queues a job again with its id appended; () where users cannot ask for it.
    requeue_argv: tuple[str, ...] = ()

    def job_id(self, env: Env) -> tuple[str, str] | None:
        """``(variable, job id)`` when this process runs in one of this scheduler's jobs."""
        return _first(env, self.job_id_variables)

    def hosts(self, env: Env) -> list[str] | None:
        """The job's hosts in node order, each once; None where nothing names them. A
        malformed list is a ``UserError``."""
        return None

    def end_time_variable(self, env: Env) -> str | None:
        """The variable that holds the allocation's end, where one is set."""
        found = _first(env, self.end_time_variables)
        return found[0] if found else None

    def requeue_command(self, job_id: str) -> tuple[str, ...]:
        """The command that queues job ``job_id`` again; () where the scheduler has none a user may run."""
        return (*self.requeue_argv, job_id) if self.requeue_argv and job_id else ()


class SlurmJob(SchedulerJob):
    name = "slurm"
    job_id_variables = ("SLURM_JOB_ID",)
    #: Newer Slurm releases (not 22.05) set it.
    end_time_variables = ("SLURM_JOB_END_TIME",)
    requeue_argv = ("scontrol", "requeue")

    def hosts(self, env: Env) -> list[str] | None:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        return expand_nodelist(nodelist) if nodelist else None


class PbsJob(SchedulerJob):
    """PBS sets no end time (its rendered scripts export the deadline) and has no requeue a
    user may ask for (``qrerun`` is an operator's)."""

    name = "pbs"
    job_id_variables = ("PBS_JOBID",)

    def hosts(self, env: Env) -> list[str] | None:
        nodefile = env.get("PBS_NODEFILE", "").strip()
        return read_nodefile(nodefile) if nodefile else None


BUILT_IN_JOBS: tuple[SchedulerJob, ...] = (SlurmJob(), PbsJob())


@lru_cache(maxsize=1)
def site_jobs() -> tuple[SchedulerJob, ...]:
    """The ``SchedulerJob`` classes other packages register in ``ddp_hpc.jobs`` (one that
    cannot be loaded, or is not a ``SchedulerJob``, is left out with a warning)."""
    return site_objects(GROUP, SchedulerJob, skip={job.name for job in BUILT_IN_JOBS})


def scheduler_jobs() -> tuple[SchedulerJob, ...]:
    """Every scheduler's job this install knows, in the order they are asked."""
    return (*BUILT_IN_JOBS, *site_jobs())


def jobs_asked(env: Env) -> Iterator[SchedulerJob]:
    """The built-in jobs, then a site's: its entry points are read only where no built-in
    job's id is here (a SLURM or PBS rank never imports a site's package)."""
    yield from BUILT_IN_JOBS
    if not any(job.job_id(env) for job in BUILT_IN_JOBS):
        yield from site_jobs()


def current_job(env: Env) -> tuple[SchedulerJob, str, str] | None:
    """``(job, variable, job id)`` of the scheduler job this process runs in, or None outside one."""
    for job in jobs_asked(env):
        found = job.job_id(env)
        if found:
            return job, *found
    return None


def job_id_variables() -> tuple[str, ...]:
    """Every variable a job id is read from, in the order they are asked (for messages)."""
    return tuple(name for job in scheduler_jobs() for name in job.job_id_variables)


def end_time_variable(env: Env) -> str | None:
    """The variable that holds the allocation's end: the current job's first, then any job's
    (a step launched with a partial environment may keep the end time without the id)."""
    found = current_job(env)
    ordered = ([found[0]] if found else []) + [job for job in jobs_asked(env) if not found or job is not found[0]]
    return next((name for job in ordered if (name := job.end_time_variable(env))), None)


def job_hosts(env: Env) -> list[str]:
    """The hosts of the first job whose node list is here, in node order; [] when none is or
    it cannot be read (``resolve_env`` reports a malformed list)."""
    for job in jobs_asked(env):
        try:
            hosts = job.hosts(env)
        except (UserError, OSError):
            return []
        if hosts:
            return hosts
    return []

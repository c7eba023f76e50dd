"""The scheduler interface: a dry run that is pure data, then submit, state and cancel.

As in torchx (``schedule(submit_dryrun(app, cfg))``), what ``--dry-run`` prints is the very
``DryRun`` that ``submit`` executes. A backend is one module with one ``Scheduler``
subclass in its family's package, listed in its ``SchedulerFamily``, which the family's
package registers through an entry point (``schedulers/registry.py``); nothing else branches
on a scheduler's name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from ddp_hpc.environment.jobs import SchedulerJob
from ddp_hpc.schedulers.facts import ClusterReader
from ddp_hpc.contract import ElementRecord, Submission, atomic_write  # noqa: F401  (the records live in contract/)
from ddp_hpc.errors import UserError
from ddp_hpc.specs.request import SubmitRequest, quote_command


class JobState(str, Enum):
    """Every scheduler's states, mapped through each backend's table onto these."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    #: The scheduler does not know the job (any more) and no exit file says how it ended.
    UNKNOWN = "unknown"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT)


@dataclass(frozen=True)
class JobStatus:
    state: JobState
    #: The job's exit status where known (the batch script's, or the scheduler's).
    exit_code: int | None = None
    #: The scheduler's own word for it (``RUNNING``, ``R``, ``CANCELLED by 0``).
    raw: str = ""
    #: Which source answered (``sacct``, ``scontrol``, ``squeue``, ``qstat``, ``exit file``).
    source: str = ""


@dataclass(frozen=True)
class DryRun:
    """Everything ``submit`` will do, as data: printed by ``--dry-run``."""

    scheduler: str
    request: SubmitRequest
    workdir: Path
    #: The per-rank command (``ddp-hpc train ...`` or ``ddp-hpc run -- ...``).
    rank_argv: tuple[str, ...]
    script: str | None = None
    script_path: Path | None = None
    submit_argv: tuple[str, ...] = ()
    #: The submit command reads the script on its standard input (LSF's ``bsub < job.lsf``),
    #: not as an argument.
    script_on_stdin: bool = False
    #: Parameters for a Python submitter (submitit's ``update_parameters``).
    parameters: Mapping[str, Any] = field(default_factory=dict)

    @property
    def run_folder(self) -> Path:
        folder = self.request.run_folder
        return folder if folder.is_absolute() else self.workdir / folder

    def describe(self) -> str:
        parts = []
        if self.script is not None:
            parts.append(self.script.rstrip("\n"))
            parts.append("")
        parts.append(f"# per-rank command ({self.request.world_size} ranks): {quote_command(self.rank_argv)}")
        for element in self.request.elements:
            parts.append(f"# sweep element {element.index}: {element.describe()} -> "
                         f"{self.request.element_run_folder(element)}")
        if self.submit_argv:
            stdin = f" < {quote_command([str(self.script_path)])}" if self.script_on_stdin and self.script_path else ""
            parts.append(f"# would run: {quote_command(self.submit_argv)}{stdin}")
        if self.request.chain > 1:
            parts.append(f"# then {self.request.chain - 1} more link(s), each after the previous one ended "
                         "(afterany); each resumes from the run's newest checkpoint")
        if self.parameters:
            parts.append(f"# would submit with {self.scheduler}, parameters:")
            parts += [f"#   {key} = {value!r}" for key, value in sorted(self.parameters.items())]
        return "\n".join(parts) + "\n"


def fold(statuses: Sequence[JobStatus]) -> JobStatus:
    """A sweep's state: running while any element is not over; then completed only if all did."""
    for state in (JobState.RUNNING, JobState.PENDING, JobState.UNKNOWN):
        if any(s.state is state for s in statuses):
            return JobStatus(state, None, f"{sum(s.state.is_terminal for s in statuses)}/{len(statuses)} ended",
                             "elements")
    failed = [s for s in statuses if s.state is not JobState.COMPLETED]
    code = next((s.exit_code for s in failed if s.exit_code), 1 if failed else 0)
    return JobStatus(JobState.FAILED if failed else JobState.COMPLETED, code,
                     f"{len(statuses) - len(failed)}/{len(statuses)} completed", "elements")


def read_exit_file(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def run_tool(argv: Sequence[str], what: str, cwd: Path | None = None, timeout: float = 60) -> str:
    """Run a scheduler command; a missing tool or a failure is one line."""
    if shutil.which(argv[0]) is None:
        raise UserError(f"{argv[0]} not found on PATH: {what}")
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{argv[0]} did not answer within {timeout:.0f}s") from None
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise UserError(f"{argv[0]} failed (exit {result.returncode}): {detail[0] if detail else 'no output'}")
    return result.stdout.strip()


def query_tool(argv: Sequence[str], timeout: float = 30) -> str | None:
    """A status query's output, or None where the tool is missing, fails or hangs
    (status polling tolerates a transient failure and tries the next source)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return result.stdout if result.returncode == 0 else None


def write_script(text: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)

    def executable(handle: BinaryIO) -> None:
        handle.write(text.encode())
        os.fchmod(handle.fileno(), 0o755)

    atomic_write(path, executable, durable=False)  # rendered again from the request at will
    return path


@dataclass(frozen=True)
class RunOpt:
    """A command-line option a backend declares for its family's ``render`` and ``submit``
    (torchx's ``run_opts``): the CLI adds what the registry hands it, and branches on no
    family or backend name."""

    flags: tuple[str, ...]
    help: str
    #: ``job``: among the job's options (after ``--max-restarts``); ``backend``: picks the
    #: backend that declares it when set (``--sbatch``).
    group: str = "job"
    #: More ``add_argument`` keywords (``type``, ``default``, ``action``, ``metavar``).
    options: Mapping[str, Any] = field(default_factory=dict)
    #: The ``SubmitRequest`` field the option's value goes to (``spare_nodes``), if any.
    request_field: str | None = None

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def add_to(self, parser: Any) -> None:
        parser.add_argument(*self.flags, help=self.help, **self.options)


def spare_nodes_opt(what: str) -> RunOpt:
    """``--spare-nodes K`` of a family whose restart leaves out a failed node: ``what`` says how."""
    return RunOpt(("--spare-nodes",), f"request K extra nodes; a restart (--max-restarts) {what}", "job",
                  {"type": int, "default": 0, "metavar": "K"}, request_field="spare_nodes")


def recover_opt(how: str) -> RunOpt:
    """``--recover N`` of a family whose script ends in ``ddp-hpc launch --recover``: ``how`` names that launch."""
    return RunOpt(("--recover",), "in-job recovery (DDP and FSDP2 loops on InJobRecovery, the Trainer): replace a lost "
                  "or frozen rank from the survivors' memory at most N times, the others staying up, before a restart "
                  f"in place ({how})", "job", {"type": int, "default": 0, "metavar": "N"}, request_field="recover")


class Scheduler(ABC):
    """One way of submitting. Subclasses fill in a few hooks."""

    #: The backend's name (``pbs``, ``sbatch``, ``submitit``, ``local``): what ``submit`` records.
    name: ClassVar[str]
    #: The family this backend belongs to: its ``SchedulerFamily``'s name and the profiles' ``scheduler``.
    family: ClassVar[str]
    #: The batch script's file suffix, where there is a script.
    script_suffix: ClassVar[str] = ""
    #: Command-line options this backend adds to its family's ``render``/``submit``.
    run_opts: ClassVar[tuple[RunOpt, ...]] = ()
    #: The profile launchers (``launcher:``) that run under this backend.
    launchers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def dry_run(self, request: SubmitRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        """What submitting ``request`` from ``workdir`` would do (pure: nothing runs)."""

    @abstractmethod
    def submit(self, dry_run: DryRun) -> Submission:
        """Do exactly what ``dry_run`` says; return the recorded submission."""

    @abstractmethod
    def job_status(self, job_id: str, exit_file: Path) -> JobStatus:
        """One job's (or array element's) state now; UNKNOWN where no source knows it."""

    @abstractmethod
    def cancel_jobs(self, job_ids: Sequence[str]) -> None:
        """Ask the scheduler to end these jobs."""

    def element_id(self, job_id: str, index: int) -> str:
        """An array job's element, as the status and cancel tools name it (backends that
        submit sweeps as array jobs fill this in)."""
        raise NotImplementedError(f"the {self.name} scheduler submits no array jobs")

    def status(self, submission: Submission) -> JobStatus:
        """The job's state; for a sweep, every element's folded into one."""
        if not submission.elements:
            return self.job_status(submission.job_id, submission.exit_file)
        return fold(self.element_statuses(submission))

    def element_statuses(self, submission: Submission) -> list[JobStatus]:
        return [self.job_status(e.job_id, e.exit_file) for e in submission.elements]

    def cancel(self, submission: Submission) -> None:
        self.cancel_jobs(submission.chain or (submission.job_id,))

    def failure(self, submission: Submission) -> str | None:
        """A line on why a finished job failed, where the backend knows more than its state."""
        return None

    def log_files(self, submission: Submission) -> list[Path]:
        """The job's output files that exist now."""
        return [Path(p) for p in submission.logs if Path(p).exists()]

    def check_profile(self, request: SubmitRequest) -> None:
        if request.profile.scheduler != self.family:
            raise UserError(f"cluster profile {request.profile.name!r} is a {request.profile.scheduler} cluster: "
                            f"use 'ddp-hpc render {request.profile.scheduler}' or another --cluster")
        self.check_launcher(request)

    def check_launcher(self, request: SubmitRequest) -> None:
        profile = request.profile
        if profile.launcher not in self.launchers:
            raise UserError(f"cluster profile {profile.name!r}: launcher {profile.launcher!r} does not run under "
                            f"scheduler {profile.scheduler!r}: use one of {', '.join(self.launchers)}")

    def _submission(self, dry_run: DryRun, job_ids: Sequence[str], logs: Sequence[str],
                    command_line: Sequence[str]) -> Submission:
        """Record what was submitted: a job, a chain's links (``job_ids``), or an array job
        (``element_id`` names its elements)."""
        from ddp_hpc.specs.request import CommandPayload

        request = dry_run.request
        elements = tuple(
            ElementRecord(e.index, self.element_id(job_ids[-1], e.index),
                          str(_under(dry_run.workdir, request.element_run_folder(e))), e.describe())
            for e in request.elements)
        submission = Submission(
            scheduler=self.name, job_id=job_ids[-1], run_folder=str(dry_run.run_folder), workdir=str(dry_run.workdir),
            world_size=request.world_size, submitted_at=time.time(),
            kind="command" if isinstance(request.payload, CommandPayload) else "train",
            script=str(dry_run.script_path) if dry_run.script_path else None, logs=tuple(logs),
            command_line=tuple(command_line), chain=tuple(job_ids) if len(job_ids) > 1 else (), elements=elements)
        submission.record()
        for element in elements:  # `status runs/NAME-3` works for one element too
            replace(submission, run_folder=element.run_folder, elements=(element,)).record()
        return submission


@dataclass(frozen=True)
class SchedulerFamily:
    """A scheduler family (a profile's ``scheduler``), as its package registers it in the
    ``ddp_hpc.schedulers`` entry points (``schedulers/registry.py``): ``render FAMILY`` and
    ``submit FAMILY`` offer it, with the options its backends declare."""

    name: str
    #: Its backends, the default first (``submit`` without a backend option uses it; ``render``
    #: the first that writes a batch script).
    backends: tuple[type[Scheduler], ...]
    #: The cluster profile ``render``/``submit FAMILY`` use without ``--cluster``; None: the one
    #: whose ``match`` fits this machine (a generic one would render a script for another cluster).
    default_profile: str | None = None
    #: Where ``render``/``submit`` list it: ddp_hpc's families first, then the others, each by this.
    listed_at: int = 100
    #: Older spellings of its name that profiles' ``scheduler`` may still use (local: ``none``).
    old_names: tuple[str, ...] = ()
    #: Its job as the job's processes see it (job id, nodes, end time, requeue): the object the
    #: rank side finds through the ``ddp_hpc.jobs`` entry points (``environment/jobs.py``);
    #: None for a family whose jobs are plain processes (local).
    job: SchedulerJob | None = None
    #: How ``ddp-hpc cluster probe|check|which`` read its cluster (``schedulers/facts.py``);
    #: None: no ``cluster`` verbs for it.
    reader: ClusterReader | None = None

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError(f"scheduler family {self.name!r} has no backend")
        for backend in self.backends:
            if not (isinstance(backend, type) and issubclass(backend, Scheduler)):
                raise TypeError(f"scheduler family {self.name!r}: {backend!r} is not a Scheduler subclass")
            if backend.family != self.name:
                raise ValueError(f"scheduler family {self.name!r}: backend {backend.name!r} belongs to "
                                 f"{backend.family!r}")


class ScriptScheduler(Scheduler):
    """A backend that renders a batch script and hands it to a submit command (qsub,
    sbatch). Subclasses fill in the hooks; chains are links with a dependency each."""

    #: The submit tool and what to tell a user where it is missing.
    tool: ClassVar[str]
    where: ClassVar[str]

    @abstractmethod
    def render(self, request: SubmitRequest) -> str:
        """The script (pure)."""

    @abstractmethod
    def submit_argv(self, script_path: Path) -> list[str]:
        """The submit command for the script."""

    @abstractmethod
    def after(self, job_id: str) -> list[str]:
        """The options that make a job start once ``job_id`` ended, for any reason."""

    @abstractmethod
    def log_paths(self, dry_run: DryRun, job_ids: Sequence[str]) -> list[Path]:
        """Where the scheduler writes the jobs' output."""

    def job_id_from(self, output: str) -> str:
        return output.strip()

    def prepare(self, dry_run: DryRun) -> None:
        """Anything the submit command needs to exist first."""

    def dry_run(self, request: SubmitRequest, workdir: Path, script_path: Path | None = None) -> DryRun:
        self.check_profile(request)
        script_path = script_path or workdir / request.run_folder / f"job{self.script_suffix}"
        return DryRun(self.name, request, workdir, tuple(request.rank_command()), script=self.render(request),
                      script_path=script_path, submit_argv=tuple(self.submit_argv(script_path)))

    def submit(self, dry_run: DryRun) -> Submission:
        write_script(dry_run.script, dry_run.script_path)
        self.prepare(dry_run)
        hint = (f"the rendered script is at {dry_run.script_path}; submit it where {self.where} runs: "
                f"{self.tool} {dry_run.script_path}")
        job_ids: list[str] = []
        for _ in range(dry_run.request.chain):
            argv = list(dry_run.submit_argv)
            if job_ids:
                argv[-1:-1] = self.after(job_ids[-1])
            job_ids.append(self.job_id_from(run_tool(argv, hint, cwd=dry_run.workdir)))
        logs = [str(path) for path in self.log_paths(dry_run, job_ids)]
        return self._submission(dry_run, job_ids, logs, dry_run.submit_argv)


def _under(workdir: Path, folder: Path) -> Path:
    return folder if folder.is_absolute() else workdir / folder

"""``ddp-hpc launch --launcher srun``: the ranks of each attempt as one ``srun`` step, inside a
SLURM allocation, under the launch's one ``Supervisor`` (launch/supervisor.py).

What the rendered sbatch script's bash loop did around its step, the launch does here: the
step's status read through the preempted marker (``--kill-on-bad-exit`` turns the ranks' 75
into a kill of the others), the node where a rank failed left out of the next step with
``--exclude`` when the allocation has spare nodes (srun names it in
``srun: error: NODE: task N: ...``), the job requeued after a stop (``scontrol requeue``),
and the exit status written for ``--wait``/``status``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ddp_hpc.contract import RESTART_COUNT_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.launch.left_out import LeftOutHost, record_left_out
from ddp_hpc.launch.restart import Decision, record_exit, status_of_attempt
from ddp_hpc.schedulers.slurm.job_key import JOB_ID_VAR, job_key

log = logging.getLogger(__name__)

#: What srun passes on to the ranks as a stop (srun itself ends the step on SIGTERM).
FORWARDED_STOP = signal.SIGUSR2
#: The allocation's node count, as srun and sbatch export it.
NODE_COUNT_VAR = "SLURM_JOB_NUM_NODES"
#: srun's line for a task that failed: the node comes first.
_FAILED_TASK = re.compile(r"^srun: error: ([^:\s]+): task [0-9]")


@dataclass(frozen=True)
class SrunLaunch:
    """``per_node`` ranks on each of ``nodes`` nodes of the allocation; the allocation's
    other nodes (``allocated``) are spares that a restart takes in place of a failed one."""

    nodes: int
    per_node: int
    command: tuple[str, ...]
    run_folder: Path
    allocated: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise UserError(f"--nodes {self.nodes} and --nproc {self.per_node} must be >= 1")
        if self.nodes > self.allocated:
            raise UserError(f"--nodes {self.nodes}: the allocation has {self.allocated} node(s)")
        if not self.command:
            raise UserError("no command to launch: give it after '--', e.g. -- ddp-hpc doctor")

    @property
    def spare_nodes(self) -> int:
        return self.allocated - self.nodes

    def step_argv(self, excluded: Sequence[str]) -> list[str]:
        """One attempt's srun: a task per rank; a failed task ends the step (``--kill-on-bad-exit``),
        and the others get 60 s to end after the first one exits (``--wait``)."""
        argv = ["srun", "--kill-on-bad-exit=1", "--wait=60", f"--nodes={self.nodes}",
                f"--ntasks={self.nodes * self.per_node}", f"--ntasks-per-node={self.per_node}"]
        if excluded:
            argv.append(f"--exclude={','.join(excluded)}")
        return [*argv, *self.command]


def allocated_nodes(environ: Mapping[str, str]) -> int:
    """The allocation's node count; outside one, a one-line error."""
    text = environ.get(NODE_COUNT_VAR, "")
    if not text.isdigit():
        raise UserError(f"--launcher srun runs inside a SLURM allocation (sbatch, salloc): ${NODE_COUNT_VAR} "
                        "is not set")
    return int(text)


@dataclass
class _StepLog:
    """Copies a step's stderr through and keeps srun's first ``task failed`` line."""

    stream: IO[bytes]
    failed_line: str | None = None
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._copy, name="srun-stderr", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        out = sys.stderr.buffer
        for raw in self.stream:
            out.write(raw)
            out.flush()
            line = raw.decode(errors="replace").strip()
            if self.failed_line is None and _FAILED_TASK.match(line):
                self.failed_line = line

    def finished(self) -> str | None:
        if self.thread is not None:
            self.thread.join(timeout=10)
        return self.failed_line


@dataclass
class SrunSteps:
    """The attempts of one launch: ``start`` for the supervisor, ``read_status`` for its policy."""

    launch: SrunLaunch
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    excluded: list[str] = field(default_factory=list)
    _step_log: _StepLog | None = None
    _started_at: float = 0.0

    def start(self, attempt: int) -> list[subprocess.Popen]:
        if attempt > 0 and self.launch.spare_nodes:
            self._leave_out_failed_node(attempt - 1)
        argv = self.launch.step_argv(self.excluded)
        # The marker's time is the file system's, in whole seconds (as the bash loop's `date +%s`).
        self._started_at = float(int(time.time()))
        try:
            step = subprocess.Popen(argv, stderr=subprocess.PIPE,
                                    env={**self.base_env, RESTART_COUNT_VAR: str(attempt)})
        except OSError as exc:
            raise UserError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        assert step.stderr is not None
        self._step_log = _StepLog(step.stderr)
        self._step_log.start()
        return [step]

    def read_status(self, attempt: int, status: int) -> int:
        """75 where rank 0 wrote the preempted marker during this attempt: srun's
        ``--kill-on-bad-exit`` ended the others, and srun's status says a kill."""
        if self._step_log is not None:
            self._step_log.finished()
        return status_of_attempt(self.launch.run_folder, self._started_at, status)

    def _leave_out_failed_node(self, failed_attempt: int) -> None:
        line = self._step_log.finished() if self._step_log is not None else None
        match = _FAILED_TASK.match(line or "")
        if match is None or match.group(1) in self.excluded:
            return
        host = match.group(1)
        self.excluded.append(host)
        record_left_out(self.launch.run_folder, LeftOutHost(host, failed_attempt, line or ""))
        log.warning("leaving out node(s) %s, where a rank failed (%s)", ",".join(self.excluded), line)


def end_of_job(decision: Decision, run_folder: Path, environ: Mapping[str, str], *, requeue: bool) -> None:
    """After the launch: requeue the job after a stop (where asked: a single job, not a
    chain), else record its exit status for ``--wait``/``status``."""
    key = job_key(environ)
    if requeue and decision.requeue:
        log.warning("requeueing job %s", key)
        try:
            done = subprocess.run(["scontrol", "requeue", environ.get(JOB_ID_VAR, "")], check=False).returncode == 0
        except OSError:
            done = False
        if not done:
            log.error("requeue failed")
        return
    if key:
        record_exit(run_folder, key, decision.status)

"""``ddp-hpc launch --launcher srun``: the ranks of each attempt as one ``srun`` step, inside a
SLURM allocation (``SrunSteps``, an ``Attempts``: launch/attempts.py), under the launch's one
``Supervisor`` (``entry.launch``).

What a rendered sbatch script's bash loop once did around its step, the launch does: the
step's outcome read through the preempted marker (``attempts.MarkedAttempts``:
``--kill-on-bad-exit`` turns the ranks' 75 into a kill of the others), the node where a rank
failed left out of the next step with ``--exclude`` when the allocation has spare nodes
(srun names it in ``srun: error: NODE: task N: ...``: ``outcome.failed_rank_in_srun_line``),
and at the end (``srun_end``, the launch's one ``restart.LaunchEnd``) the job requeued after
a stop (``scontrol requeue``) or its exit status written for ``--wait``/``status``.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ddp_hpc.contract import RESTART_COUNT_VAR
from ddp_hpc.contract.slurm_job_key import JOB_ID_VAR, job_key
from ddp_hpc.environment.jobs import SlurmJob
from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import signal_running
from ddp_hpc.launch.left_out import LeftOutHost, leave_out
from ddp_hpc.launch.outcome import FailedRank, failed_rank_in_srun_line
from ddp_hpc.launch.restart import LaunchEnd
from ddp_hpc.launch.script import split_staged

log = logging.getLogger(__name__)

#: What srun passes on to the ranks as a stop, one task per rank (``SrunLaunch.forwarded_stop``).
FORWARDED_STOP = signal.SIGUSR2
#: The allocation's node count, as srun and sbatch export it.
NODE_COUNT_VAR = "SLURM_JOB_NUM_NODES"


@dataclass(frozen=True)
class TorchrunAgents:
    """One torchrun per node starts that node's ranks, with its c10d rendezvous at
    ``endpoint`` (``HOST:PORT``). It never restarts (``--max-restarts 0``): its agent would
    restart a stop (75) as a failure; the launch restarts, under the one policy."""

    endpoint: str
    rdzv_id: str

    def argv(self, nodes: int, per_node: int) -> list[str]:
        return ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id, "--max-restarts", "0", "--no-python"]


@dataclass(frozen=True)
class SrunLaunch:
    """``per_node`` ranks on each of ``nodes`` nodes of the allocation; the allocation's
    other nodes (``allocated``) are spares that a restart takes in place of a failed one.
    With ``torchrun``, srun starts one torchrun per node, which starts the node's ranks.
    Built from a checked ``LaunchSpec`` (launch/spec.py)."""

    nodes: int
    per_node: int
    command: tuple[str, ...]
    run_folder: Path
    allocated: int
    torchrun: TorchrunAgents | None = None

    @property
    def spare_nodes(self) -> int:
        return self.allocated - self.nodes

    @property
    def tasks_per_node(self) -> int:
        return 1 if self.torchrun is not None else self.per_node

    @property
    def forwarded_stop(self) -> int:
        """What the launch sends srun for a stop, which srun passes on to its tasks: SIGUSR2
        to the ranks; SIGTERM to torchrun agents (SIGUSR2 kills them), which pass it on to
        their ranks."""
        return signal.SIGTERM if self.torchrun is not None else FORWARDED_STOP

    def step_argv(self, excluded: Sequence[str]) -> list[str]:
        """One attempt's srun: a task per rank (or per node, with torchrun); a failed task ends
        the step (``--kill-on-bad-exit``), and the others get 60 s to end after the first one
        exits (``--wait``)."""
        argv = ["srun", "--kill-on-bad-exit=1", "--wait=60", f"--nodes={self.nodes}",
                f"--ntasks={self.nodes * self.tasks_per_node}", f"--ntasks-per-node={self.tasks_per_node}"]
        if excluded:
            argv.append(f"--exclude={','.join(excluded)}")
        agents = self.torchrun.argv(self.nodes, self.per_node) if self.torchrun is not None else []
        staged, command = split_staged(self.command)  # --stage-env: torchrun from the node's copy too
        return [*argv, *staged, *agents, *command]


@dataclass
class _StepLog:
    """Copies a step's stderr through and keeps what srun's first ``task failed`` line says."""

    stream: IO[bytes]
    failed: FailedRank | None = None
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
            if self.failed is None:
                self.failed = failed_rank_in_srun_line(line)

    def finished(self) -> FailedRank | None:
        if self.thread is not None:
            self.thread.join(timeout=10)
        return self.failed


@dataclass
class SrunSteps:
    """The attempts of one launch, one srun step each (an ``Attempts`` that names the failed
    node: ``outcome.NamesFailedHost``)."""

    launch: SrunLaunch
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    excluded: list[str] = field(default_factory=list)
    _step_log: _StepLog | None = None

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> Sequence[subprocess.Popen]:
        argv = self.launch.step_argv(self.excluded)
        try:
            step = subprocess.Popen(argv, stderr=subprocess.PIPE,
                                    env={**self.base_env, RESTART_COUNT_VAR: str(attempt), **(extra_env or {})})
        except OSError as exc:
            raise UserError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        assert step.stderr is not None
        self._step_log = _StepLog(step.stderr)
        self._step_log.start()
        return [step]

    def describe(self) -> str:
        return f"{shlex.join(self.launch.step_argv([]))}\n"

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        """srun passes the stop (SIGUSR2) on to one task per rank. A step of torchrun agents
        needs more: srun answers its own SIGTERM by killing the step at once, and an agent dies
        of SIGUSR2: Slurm signals the job's steps (``scancel --signal``, which leaves out the
        batch shell, the launch), and each agent passes SIGTERM on to its ranks."""
        if self.launch.torchrun is None:
            signal_running(children, signum)
            return
        if not any(child.returncode is None for child in children):
            return  # the step is not started yet (the supervisor passes the stop on once it is)
        job = self.base_env.get(JOB_ID_VAR, "")
        name = signal.Signals(signum).name.removeprefix("SIG")
        try:
            done = subprocess.run(["scancel", f"--signal={name}", job], env=dict(self.base_env),
                                  check=False).returncode == 0
        except OSError:
            done = False
        if not done:
            log.error("cannot pass the stop on to the steps of job %s (scancel --signal=%s)", job, name)

    def read_status(self, attempt: int, status: int) -> int:
        """The step's status (the launch reads a stop through the preempted marker:
        ``--kill-on-bad-exit`` ended the others, and srun's status says a kill), once its
        stderr is copied through."""
        if self._step_log is not None:
            self._step_log.finished()
        return status

    @property
    def has_spare(self) -> bool:
        return self.launch.spare_nodes > 0

    def failed_rank(self, attempt: int) -> FailedRank | None:
        """The node srun named for the first failed task of the step started last."""
        return self._step_log.finished() if self._step_log is not None else None

    def run_without(self, host: LeftOutHost) -> None:
        leave_out(self.launch.run_folder, self.excluded, host)


def srun_end(run_folder: Path, environ: Mapping[str, str], *, requeue: bool) -> LaunchEnd:
    """The launch's end in a SLURM job: the job requeued after a stop (where asked: a single
    job, not a chain), else its exit status recorded for ``--wait``/``status``."""
    return LaunchEnd(run_folder, job_key(environ),
                     requeue=SlurmJob().requeue_command(environ.get(JOB_ID_VAR, "")) if requeue else ())

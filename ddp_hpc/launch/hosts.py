"""``ddp-hpc launch --hostfile``: mpiexec over the hosts of a file, outside any scheduler.

Each attempt is one mpiexec over the first ``--nodes`` hosts not left out, under the
launch's one ``Supervisor`` and restart policy (launch/supervisor.py, launch/restart.py):
``HostfileAttempts`` starts it and reads its status. When the file lists more hosts than
``--nodes`` and restarts are allowed, each rank runs under a wrapper that records how it
failed (``RANK_FAILURE_WRAPPER``), and the restart leaves out the host of the first rank
that failed, taking a spare one; each left-out host is recorded in
``RUN/left-out-hosts.jsonl``. Outside a scheduler the launch is recorded as a ``local`` job
in the run folder (its pid is the job id), so ``ddp-hpc status RUN`` shows how it ended and
what it left out; a rendered PBS script ends in this launch with its job id (``--job-id``),
and the launch writes that job's exit file instead.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddp_hpc.contract import (BACKEND_VAR, DEVICE_VAR, HOST_SUFFIX_VAR, LOCAL_SCHEDULER, RECOVERY_STORE_VAR,
                              RESTART_COUNT_VAR, RUN_FOLDER_VAR, SNAPSHOT_DIR_VAR, Submission, atomic_write)
from ddp_hpc.environment.hosts import with_suffix
from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import signal_running, start_all
from ddp_hpc.launch.left_out import LeftOutHost, leave_out
from ddp_hpc.launch.local import rank_command
from ddp_hpc.launch.mpi import MpiLaunch, build_mpiexec, mpi_flavour
from ddp_hpc.launch.node import node_supervisor_command, store_host
from ddp_hpc.launch.outcome import FailedRank, failed_rank_in_file
from ddp_hpc.launch.recovering import RecoveryLimits
from ddp_hpc.launch.script import recording_rank_failures

log = logging.getLogger(__name__)

#: Each attempt's hosts, one per line, in the run folder (rewritten by every attempt).
ATTEMPT_HOSTFILE = ".hosts"
#: Rank 0's port when ``$MASTER_PORT`` is unset (torch's default).
DEFAULT_MASTER_PORT = 29500
#: What Open MPI must pass on to ranks on other hosts (MPICH passes the whole environment).
FORWARDED = ("PATH", "MASTER_ADDR", "MASTER_PORT", RESTART_COUNT_VAR, RUN_FOLDER_VAR)


def chosen_device_vars() -> tuple[str, ...]:
    """The user's device and backend choice, where set, for every rank (Open MPI passes a
    variable to another host only by name)."""
    return tuple(name for name in (DEVICE_VAR, BACKEND_VAR) if os.environ.get(name))


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")


def read_hostfile(path: Path) -> tuple[str, ...]:
    """One host name per line (``#`` starts a comment; a repeated name counts once), as in
    PBS's node file. MPI's own ``host:slots`` or ``slots=N`` forms are refused: ``--nproc``
    says how many ranks each host runs."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UserError(f"--hostfile {path}: not a text file of host names") from None
    hosts: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not _HOST_NAME.match(name):
            raise UserError(f"--hostfile {path}, line {number}: {name!r} is not a host name (one name per line; "
                            "--nproc gives the ranks per host)")
        if name not in hosts:
            hosts.append(name)
    if not hosts:
        raise UserError(f"--hostfile {path} lists no host")
    return tuple(hosts)


@dataclass(frozen=True)
class HostLaunch:
    """``per_node`` ranks on each of the first ``nodes`` hosts; the hosts after those are
    spares that a restart takes in place of one where a rank failed. Built from a checked
    ``LaunchSpec`` (launch/spec.py), which refuses what does not fit."""

    flavour: str
    hosts: tuple[str, ...]
    nodes: int
    per_node: int
    command: tuple[str, ...]
    run_folder: Path
    max_restarts: int = 0
    #: Rank 0's address is its host's short name followed by this (a cluster profile's
    #: ``host_suffix``: the high-speed network's name); empty: the host's name as listed.
    host_suffix: str = ""
    #: The mpiexec to run (a script looked it up); None: the flavour's first installed one.
    program: str | None = None
    #: Cray PALS: ``--cpu-bind`` and ``--depth`` (a cluster profile's ``cpu_bind``, ``depth``).
    cpu_bind: str | None = None
    depth: int | None = None
    #: ``--recover``: mpiexec starts one node supervisor per host (``launch/node.py``), which
    #: starts that host's ranks and replaces a lost one in place.
    recovery: RecoveryLimits | None = None

    def master_addr(self, host: str) -> str:
        """Rank 0's address on ``host``."""
        return with_suffix(host, self.host_suffix) if self.host_suffix else host

    @property
    def spare_nodes(self) -> int:
        return len(self.hosts) - self.nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def leaves_out_failed_hosts(self) -> bool:
        return self.max_restarts > 0 and self.spare_nodes > 0

    @property
    def tasks_per_host(self) -> int:
        """mpiexec's tasks on each host: the ranks, or one node supervisor under ``--recover``."""
        return 1 if self.recovery is not None else self.per_node


def recovery_store_host(launch: HostLaunch, environ: Mapping[str, str]) -> str:
    """Where the node supervisors reach the launch's recovery store: loopback where the one
    host (and no spare) is this machine, else this machine's name with the host suffix
    (``node.store_host``)."""
    here = launch.nodes == 1 and launch.spare_nodes == 0 and (
        launch.hosts[0].split(".")[0] == socket.gethostname().split(".")[0])
    suffix = {HOST_SUFFIX_VAR: launch.host_suffix} if launch.host_suffix else {}
    return store_host({**environ, **suffix}, local=here)


@dataclass
class HostfileAttempts:
    """The attempts of one launch (an ``Attempts``, launch/attempts.py, which names the failed
    host: ``outcome.NamesFailedHost``; the launch reads each one's outcome through
    ``attempts.MarkedAttempts``)."""

    launch: HostLaunch
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    excluded: list[str] = field(default_factory=list)
    #: The hosts of the attempt started last, in rank order (``per_node`` ranks each).
    hosts: tuple[str, ...] = ()

    @property
    def hostfile(self) -> Path:
        return self.launch.run_folder / ATTEMPT_HOSTFILE

    def argv(self) -> list[str]:
        """Each attempt's mpiexec; with spares, or under an MPI whose status may lose a stop (MPICH's), every
        task runs under the wrapper that records how it ended. Under ``--recover`` the task is a
        node supervisor, unbound (its ranks would inherit a binding meant for one rank)."""
        launch, recovery = self.launch, self.launch.recovery
        argv = (rank_command(launch.command) if recovery is None
                else node_supervisor_command(launch.per_node, recovery, launch.command))
        if launch.leaves_out_failed_hosts or mpi_flavour(launch.flavour).loses_stop_status:
            argv = recording_rank_failures(argv)
        bound = recovery is None
        return build_mpiexec(MpiLaunch(launch.flavour, launch.nodes, launch.tasks_per_host, argv,
                                       hostfile=str(self.hostfile),
                                       forward=(*FORWARDED, *chosen_device_vars(),
                                                *(() if bound else (RECOVERY_STORE_VAR, SNAPSHOT_DIR_VAR))),
                                       cpu_bind=launch.cpu_bind if bound else None,
                                       depth=launch.depth if bound else None,
                                       allow_root=os.geteuid() == 0), program=launch.program)

    def describe(self) -> str:
        """``--dry-run``: the hosts and each attempt's command."""
        return (f"# {self.launch.world_size} ranks = {self.launch.nodes} host(s) x {self.launch.per_node}, "
                f"{self.launch.spare_nodes} spare; rank 0 on the first host of each attempt "
                f"({', '.join(self.launch.hosts[:self.launch.nodes])} first)\n{shlex.join(self.argv())}\n")

    def start(self, attempt: int, extra_env: Mapping[str, str] | None = None) -> list[subprocess.Popen]:
        self.hosts = tuple(host for host in self.launch.hosts if host not in self.excluded)[:self.launch.nodes]
        if len(self.hosts) < self.launch.nodes:
            log.warning("no spare node left: the restart gets fewer than %d node(s)", self.launch.nodes)
        atomic_write(self.hostfile, "".join(f"{host}\n" for host in self.hosts), durable=False)
        port = self.base_env.get("MASTER_PORT") or str(DEFAULT_MASTER_PORT)
        master = self.launch.master_addr(self.hosts[0])
        env = {**self.base_env, "MASTER_ADDR": master, "MASTER_PORT": port,
               RUN_FOLDER_VAR: str(self.launch.run_folder), RESTART_COUNT_VAR: str(attempt), **(extra_env or {})}
        if attempt == 0:
            log.warning("launch %d: %d ranks on %d host(s), rank 0 at %s:%s; run folder %s", os.getpid(),
                        self.launch.world_size, len(self.hosts), master, port, self.launch.run_folder)
        elif self.excluded:
            log.warning("next attempt on %s, rank 0 at %s", ",".join(self.hosts), master)
        return start_all([(self.argv(), env)])

    def forward_stop(self, signum: int, children: Sequence[subprocess.Popen]) -> None:
        signal_running(children, signum)

    def read_status(self, attempt: int, status: int) -> int:
        return status

    @property
    def has_spare(self) -> bool:
        return self.launch.leaves_out_failed_hosts

    def failed_rank(self, attempt: int) -> FailedRank | None:
        """The first failed rank of the attempt started last, from its wrapper's file."""
        task = "rank" if self.launch.recovery is None else "the node supervisor of host"
        return failed_rank_in_file(self.launch.run_folder, attempt, self.hosts, self.launch.tasks_per_host, task)

    def run_without(self, host: LeftOutHost) -> None:
        leave_out(self.launch.run_folder, self.excluded, host)


def record_this_launch(run_folder: Path, world_size: int, command_line: Sequence[str]) -> str:
    """Record this process (``ddp-hpc launch --hostfile``, which writes ``exit-<pid>`` when it
    ends) as a ``local`` job in ``run_folder``, so that ``ddp-hpc status``/``cancel`` work
    from the folder; its job id, the pid."""
    job_id = str(os.getpid())
    Submission(scheduler=LOCAL_SCHEDULER, job_id=job_id, run_folder=str(run_folder), workdir=str(Path.cwd()),
               world_size=world_size, submitted_at=time.time(), kind="command",
               command_line=tuple(command_line)).record()
    return job_id


def __getattr__(name: str) -> object:
    if name == "HostfileSteps":  # the old name: its attempts are mpiexec runs, not srun steps
        import warnings

        warnings.warn("ddp_hpc.launch.hosts.HostfileSteps is deprecated: use HostfileAttempts", DeprecationWarning,
                      stacklevel=2)
        return HostfileAttempts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

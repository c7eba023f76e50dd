"""``LaunchSpec``: what ``ddp-hpc launch`` was asked to do, checked in one place.

``from_arguments`` builds it from the parsed command line and the few variables the launch
reads (the run folder, a SLURM allocation's size, the recovery store of a node supervisor,
the requested backend); ``LaunchSpec.__post_init__`` refuses what does not fit, each refusal
once, in one line (``UserError``: exit 2). ``entry.launch`` runs it.

The spec holds its launcher, an object (``launchers/``: one module per ``--launcher NAME``,
found through entry points, and the node supervisor that ``--node-supervisor`` chooses),
which checks the flags only it reads and says how the launch runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import BACKEND_VAR, RECOVERY_STORE_VAR, RUN_FOLDER_VAR, ExitStatus
from ddp_hpc.device import requested
from ddp_hpc.errors import UserError
from ddp_hpc.launch.hosts import read_hostfile
from ddp_hpc.launch import registry
from ddp_hpc.launch.launchers.base import Launcher
from ddp_hpc.launch.launchers.node_supervisor import NodeSupervisor
from ddp_hpc.launch.recovering import RecoveryLimits
from ddp_hpc.launch.restart import record_exit
from ddp_hpc.launch.srun import NODE_COUNT_VAR


@dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]
    nproc: int = 2
    #: The launcher (``launchers/``), or its name (``--launcher``); a node supervisor's, whatever was given.
    launcher: Launcher | str = "local"
    max_restarts: int = 0
    dry_run: bool = False
    #: ``--recover N`` (and its options); a node supervisor's always.
    recovery: RecoveryLimits | None = None
    #: ``--run-folder``; the launch on this machine writes ``exit-<pid>`` there.
    run_folder: Path | None = None
    #: ``$DDP_HPC_RUN_FOLDER`` where ``--run-folder`` is not given (``here``, ``srun``).
    inherited_run_folder: Path | None = None
    nodes: int | None = None
    hostfile: Path | None = None
    #: The hosts ``hostfile`` lists (``hosts.read_hostfile``).
    hosts: tuple[str, ...] = ()
    mpiexec: str | None = None
    cpu_bind: str | None = None
    depth: int | None = None
    host_suffix: str | None = None
    job_id: str | None = None
    #: ``--stop-signal``'s signal number.
    stop_signal: int | None = None
    requeue: bool = False
    torchrun: str | None = None
    node_supervisor: bool = False
    #: ``srun``: the allocation's node count (``$SLURM_JOB_NUM_NODES``), None outside one.
    allocated: int | None = None
    #: ``node``: the outer launch's recovery store (``$DDP_HPC_RECOVERY_STORE``).
    store_address: str = ""
    #: ``$DDP_HPC_BACKEND`` (in-job recovery refuses some backends before any rank starts).
    backend: str = "auto"
    #: The launch's own command line (a ``--hostfile`` launch records it as a ``local`` job).
    command_line: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        chosen = NodeSupervisor() if self.node_supervisor else self.launcher
        object.__setattr__(self, "launcher", registry.get(chosen) if isinstance(chosen, str) else chosen)
        self.chosen.check(self)
        if not self.command:
            raise UserError("no command to launch: give it after '--', e.g. -- ddp-hpc doctor")
        if self.nproc < 1:
            raise UserError(f"--nproc {self.nproc} must be >= 1")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts} must be >= 0")
        self.chosen.check_placement(self)
        if self.recovery is not None:
            from ddp_hpc.engine.recovery.backends import backend_refusal, host_refusal

            if self.backend != "auto" and (why := backend_refusal(self.backend)):
                raise UserError(f"--recover with ${BACKEND_VAR}={self.backend}: {why}")
            # Ranks on this host (here, or a node supervisor's): a head node that starts mpiexec need have no GPU.
            if self.backend != "auto" and self.chosen.ranks_here(self) and (why := host_refusal(self.backend)):
                raise UserError(f"--recover with ${BACKEND_VAR}={self.backend}: {why}")
            if self.recovery.shrink and self.node_count > 1:
                raise UserError("--shrink works on one node only for now: give --nodes 1, or recover with a "
                                "replacement")

    @property
    def chosen(self) -> Launcher:
        """The launcher object (``launcher``, resolved from a name when the spec was made)."""
        assert isinstance(self.launcher, Launcher)
        return self.launcher

    @property
    def folder(self) -> Path | None:
        """Where the launch keeps its files: ``--run-folder``, else the inherited one."""
        return self.run_folder or self.inherited_run_folder

    @property
    def node_count(self) -> int:
        """The nodes each attempt runs on (``--nodes``, else every host or allocated node)."""
        return self.chosen.node_count(self)


def from_arguments(args: argparse.Namespace, environ: Mapping[str, str], command_line: Sequence[str]) -> LaunchSpec:
    """The spec of ``ddp-hpc launch``'s parsed ``args``. A refused launch over a hostfile with
    ``--job-id`` (a PBS script's) still writes that job's exit file: ``--wait`` and ``status``
    see it failed."""
    folder = environ.get(RUN_FOLDER_VAR, "").strip()
    allocated = environ.get(NODE_COUNT_VAR, "")
    try:
        recovery = (RecoveryLimits(args.recover, wait_s=args.recovery_wait, shrink=args.shrink,
                                   hang_s=args.hang_timeout, warm_spare=args.warm_spare)
                    if args.recover or args.node_supervisor else None)
        return LaunchSpec(
            command=tuple(args.command), nproc=args.nproc, launcher=args.launcher, max_restarts=args.max_restarts,
            dry_run=args.dry_run, recovery=recovery,
            run_folder=Path(args.run_folder).resolve() if args.run_folder else None,
            inherited_run_folder=Path(folder) if folder else None, nodes=args.nodes,
            hostfile=Path(args.hostfile) if args.hostfile else None,
            hosts=read_hostfile(Path(args.hostfile)) if args.hostfile and not args.node_supervisor else (),
            mpiexec=args.mpiexec, cpu_bind=args.cpu_bind, depth=args.depth, host_suffix=args.host_suffix,
            job_id=args.job_id, stop_signal=args.stop_signal.signal if args.stop_signal else None,
            requeue=args.requeue, torchrun=args.torchrun, node_supervisor=args.node_supervisor,
            allocated=int(allocated) if allocated.isdigit() else None,
            store_address=environ.get(RECOVERY_STORE_VAR, "").strip(),
            backend=requested(None, environ, BACKEND_VAR), command_line=tuple(command_line))
    except UserError:
        if args.hostfile and args.job_id and args.job_id.strip() and args.run_folder:
            record_exit(Path(args.run_folder).resolve(), args.job_id, ExitStatus.FAILED)
        raise

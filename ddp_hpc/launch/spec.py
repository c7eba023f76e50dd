"""``LaunchSpec``: what ``ddp-hpc launch`` was asked to do, checked in one place.

``from_arguments`` builds it from the parsed command line and the few variables the launch
reads (the run folder, a SLURM allocation's size, the recovery store of a node supervisor,
the requested backend); ``LaunchSpec.__post_init__`` refuses what does not fit, each refusal
once, in one line (``UserError``: exit 2). ``entry.launch`` runs it.

Four modes, by the flags given:

- ``here``: ranks on this machine (``--launcher local|openmpi|mpich``);
- ``hosts``: mpiexec over the hosts of ``--hostfile`` (``openmpi|mpich|pals``);
- ``srun``: one srun step per attempt inside a SLURM allocation;
- ``node``: one node's supervisor of a recovering launch (``--node-supervisor``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import BACKEND_VAR, RECOVERY_STORE_VAR, RUN_FOLDER_VAR, ExitStatus
from ddp_hpc.device import requested
from ddp_hpc.errors import UserError
from ddp_hpc.launch.hosts import HOSTFILE_LAUNCHERS, read_hostfile
from ddp_hpc.launch.local import LOCAL_LAUNCHERS
from ddp_hpc.launch.recovering import RecoveryLimits
from ddp_hpc.launch.restart import record_exit
from ddp_hpc.launch.srun import NODE_COUNT_VAR

log = logging.getLogger(__name__)


#: Launcher names that changed, and what they are called now: ``torchrun`` started no
#: torchrun (the launch starts the ranks itself, with torchrun's variables).
RENAMED_LAUNCHERS = {"torchrun": "local"}


def launcher_name(given: str) -> str:
    """``given``, or its new name with a warning where it was renamed."""
    if given in RENAMED_LAUNCHERS:
        log.warning("--launcher %s is now called --launcher %s (the same ranks; the old name still works)", given,
                    RENAMED_LAUNCHERS[given])
        return RENAMED_LAUNCHERS[given]
    return given


@dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]
    nproc: int = 2
    launcher: str = "local"
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
        self._check_mode_flags()
        if not self.command:
            raise UserError("no command to launch: give it after '--', e.g. -- ddp-hpc doctor")
        if self.nproc < 1:
            raise UserError(f"--nproc {self.nproc} must be >= 1")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts} must be >= 0")
        self._check_placement()
        if self.recovery is not None:
            from ddp_hpc.engine.recovery.backends import backend_refusal, host_refusal

            if self.backend != "auto" and (why := backend_refusal(self.backend)):
                raise UserError(f"--recover with ${BACKEND_VAR}={self.backend}: {why}")
            # Ranks on this host (here, or a node supervisor's): a head node that starts mpiexec need have no GPU.
            if self.backend != "auto" and self.mode in ("here", "node") and (why := host_refusal(self.backend)):
                raise UserError(f"--recover with ${BACKEND_VAR}={self.backend}: {why}")
            if self.recovery.shrink and self.node_count > 1:
                raise UserError("--shrink works on one node only for now: give --nodes 1, or recover with a "
                                "replacement")

    @property
    def mode(self) -> str:
        if self.node_supervisor:
            return "node"
        if self.hostfile is not None:
            return "hosts"
        return "srun" if self.launcher == "srun" else "here"

    @property
    def folder(self) -> Path | None:
        """Where the launch keeps its files: ``--run-folder``, else the inherited one."""
        return self.run_folder or self.inherited_run_folder

    @property
    def node_count(self) -> int:
        """The nodes each attempt runs on (``--nodes``, else every host or allocated node)."""
        if self.nodes is not None:
            return self.nodes
        if self.mode == "hosts":
            return len(self.hosts)
        if self.mode == "srun" and self.allocated is not None:
            return self.allocated
        return 1

    def _check_mode_flags(self) -> None:
        """The flags only one mode reads, refused in the others."""
        mode = self.mode
        if mode == "node":
            if not self.store_address:
                raise UserError(f"--node-supervisor runs under `ddp-hpc launch --recover N --launcher "
                                f"mpich|openmpi|srun`, which serves the recovery store: ${RECOVERY_STORE_VAR} is "
                                "not set")
            return
        if mode == "hosts":
            if self.run_folder is None:
                raise UserError("--hostfile needs --run-folder DIR: where the launch records its exit status and "
                                "the hosts it leaves out")
            if self.requeue or self.torchrun is not None:
                raise UserError("--requeue and --torchrun go with --launcher srun (a launch over a hostfile "
                                "requeues nothing: it exits 75 after a stop)")
            if self.job_id is not None and not self.job_id.strip():
                raise UserError("--job-id is empty: give the scheduler's job id (a PBS script passes "
                                "\"$PBS_JOBID\")")
            if self.launcher not in HOSTFILE_LAUNCHERS:
                raise UserError(f"--hostfile starts ranks on other hosts through mpiexec: give --launcher "
                                f"{' or '.join(HOSTFILE_LAUNCHERS)} (not {self.launcher})")
            return
        given = [flag for flag, value in (("--mpiexec", self.mpiexec), ("--cpu-bind", self.cpu_bind),
                                          ("--depth", self.depth), ("--host-suffix", self.host_suffix),
                                          ("--job-id", self.job_id)) if value is not None]
        if given:
            raise UserError(f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with --hostfile (mpiexec "
                            "over listed hosts)")
        if self.launcher == "pals":
            raise UserError("--launcher pals starts ranks over the hosts of a --hostfile (a PBS job's nodes): give "
                            "--hostfile FILE")
        if mode == "srun":
            if self.folder is None:
                raise UserError(f"--launcher srun needs --run-folder DIR (or ${RUN_FOLDER_VAR}): where the launch "
                                "records its exit status and the nodes it leaves out")
            if self.allocated is None:
                raise UserError(f"--launcher srun runs inside a SLURM allocation (sbatch, salloc): "
                                f"${NODE_COUNT_VAR} is not set")
            return
        if self.nodes is not None:
            raise UserError("--nodes goes with --hostfile or --launcher srun (a launch on this machine has one node)")
        if self.stop_signal is not None or self.requeue or self.torchrun is not None:
            raise UserError("--stop-signal, --requeue and --torchrun go with --launcher srun (--stop-signal also "
                            "with --hostfile)")
        if self.launcher not in LOCAL_LAUNCHERS:
            raise UserError(f"unknown launcher {self.launcher!r}: choose one of {', '.join(LOCAL_LAUNCHERS)}")

    def _check_placement(self) -> None:
        """The nodes, and how ranks are placed on them, where the mode has several."""
        if self.mode not in ("hosts", "srun"):
            return
        if self.node_count < 1:
            raise UserError(f"--nodes {self.node_count} must be >= 1")
        if self.mode == "hosts":
            if self.node_count > len(self.hosts):
                raise UserError(f"--nodes {self.node_count}: the hostfile lists {len(self.hosts)} host(s)")
            if self.depth is not None and self.depth < 1:
                raise UserError(f"--depth {self.depth} must be >= 1")
            if (self.cpu_bind is not None or self.depth is not None) and self.launcher != "pals":
                raise UserError(f"--cpu-bind and --depth are Cray PALS's mpiexec options: give --launcher pals "
                                f"(not {self.launcher}), or leave them out")
            return
        assert self.allocated is not None
        if self.node_count > self.allocated:
            raise UserError(f"--nodes {self.node_count}: the allocation has {self.allocated} node(s)")
        if self.torchrun is not None:
            if self.recovery is not None:
                raise UserError("--torchrun and --recover: torchrun's agents restart every rank on a failure; "
                                "in-job recovery starts its own node supervisors (give one of them)")
            if ":" not in self.torchrun:
                raise UserError(f"--torchrun {self.torchrun!r}: give the rendezvous endpoint as HOST:PORT")


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
            command=tuple(args.command), nproc=args.nproc, launcher=launcher_name(args.launcher), max_restarts=args.max_restarts,
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

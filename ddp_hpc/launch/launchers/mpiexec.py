"""What the mpiexec launchers (openmpi.py, mpich.py, pals.py) share: one mpiexec on this
machine per attempt (``local.MpiexecHere``), or, with ``--hostfile``, one over the hosts of
the file (``hosts.HostfileAttempts``), which leaves out the host of a failed rank where there
is a spare; under ``--recover`` its tasks are node supervisors (``node.NodeSupervisors``)."""

from __future__ import annotations

import os
import signal
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ddp_hpc.contract import RECOVERY_STORE_VAR, RESTART_COUNT_VAR, RUN_FOLDER_VAR, SNAPSHOT_DIR_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import Attempts, MarkedAttempts
from ddp_hpc.launch.hosts import HostfileAttempts, HostLaunch, record_this_launch, recovery_store_host
from ddp_hpc.launch.launchers.base import Launcher, Plan
from ddp_hpc.launch.local import mpiexec_here, rank_command
from ddp_hpc.launch.mpi import MpiLaunch
from ddp_hpc.launch.node import NodeSupervisors, node_supervisor_command
from ddp_hpc.launch.restart import Decision, LaunchEnd
from ddp_hpc.contract import ExitStatus

if TYPE_CHECKING:
    from ddp_hpc.launch.spec import LaunchSpec


@dataclass(frozen=True)
class MpiexecLauncher(Launcher):
    over_hostfile: ClassVar[bool] = True
    #: The signal a launch sends mpiexec so that the ranks stop (they stop on SIGUSR2 and
    #: SIGTERM alike): what this mpiexec passes on.
    passes_on: ClassVar[signal.Signals] = signal.SIGUSR2
    #: Takes ``--cpu-bind`` and ``--depth`` (Cray PALS).
    binds: ClassVar[bool] = False
    #: ``mpi.MpiFlavour``: its program names, how to install it, whether its status may lose a stop.
    programs: ClassVar[tuple[str, ...]] = ("mpiexec",)
    install_hint: ClassVar[str] = "install an MPI"
    loses_stop_status: ClassVar[bool] = False

    @abstractmethod
    def mpiexec_args(self, launch: MpiLaunch, program: str) -> list[str]:
        """Its mpiexec line up to the command (``mpi.build_mpiexec``)."""

    def stop_passed_on(self, spec: LaunchSpec) -> int | None:
        return self.passes_on

    def stops(self, spec: LaunchSpec) -> set[int]:
        stops = super().stops(spec)
        if spec.hostfile is not None and spec.stop_signal is not None:  # a PBS script's --stop-signal
            stops.add(spec.stop_signal)
        return stops

    def node_count(self, spec: LaunchSpec) -> int:
        if spec.nodes is None and spec.hostfile is not None:
            return len(spec.hosts)
        return super().node_count(spec)

    def ranks_here(self, spec: LaunchSpec) -> bool:
        return spec.hostfile is None

    def check_placement(self, spec: LaunchSpec) -> None:
        if spec.hostfile is None:
            return
        nodes = self.node_count(spec)
        if nodes < 1:
            raise UserError(f"--nodes {nodes} must be >= 1")
        if nodes > len(spec.hosts):
            raise UserError(f"--nodes {nodes}: the hostfile lists {len(spec.hosts)} host(s)")
        if spec.depth is not None and spec.depth < 1:
            raise UserError(f"--depth {spec.depth} must be >= 1")
        if (spec.cpu_bind is not None or spec.depth is not None) and not self.binds:
            raise UserError(f"--cpu-bind and --depth are Cray PALS's mpiexec options: give --launcher pals "
                            f"(not {self.name}), or leave them out")

    def needs_scratch_folder(self, spec: LaunchSpec) -> bool:
        return spec.hostfile is None and self.loses_stop_status

    def plan(self, spec: LaunchSpec, folder: Path | None) -> Plan:
        if spec.hostfile is not None:
            return self._plan_hosts(spec)
        limits = spec.recovery
        if limits is None:
            attempts: Attempts = mpiexec_here(self.name, spec.nproc, rank_command(spec.command), folder)
        else:  # one mpiexec task: the node supervisor, which starts the ranks
            attempts = NodeSupervisors(mpiexec_here(
                self.name, 1, node_supervisor_command(spec.nproc, limits, spec.command), folder,
                forward=(RECOVERY_STORE_VAR, RESTART_COUNT_VAR, RUN_FOLDER_VAR, SNAPSHOT_DIR_VAR)))
        if folder is not None:
            attempts = MarkedAttempts(attempts, folder)  # mpiexec's status through the marker
        return Plan(attempts, None, LaunchEnd(spec.run_folder, str(os.getpid())) if spec.run_folder else LaunchEnd())

    def _plan_hosts(self, spec: LaunchSpec) -> Plan:
        assert spec.run_folder is not None
        limits = spec.recovery
        hosts = HostLaunch(self.name, spec.hosts, self.node_count(spec), spec.nproc, spec.command, spec.run_folder,
                           spec.max_restarts, host_suffix=spec.host_suffix or "", program=spec.mpiexec,
                           cpu_bind=spec.cpu_bind, depth=spec.depth, recovery=limits)
        attempts: Attempts = MarkedAttempts(HostfileAttempts(hosts), spec.run_folder)
        if limits is not None:
            attempts = NodeSupervisors(attempts, host=recovery_store_host(hosts, os.environ))
        return Plan(attempts, None, LaunchEnd(spec.run_folder, spec.job_id or ""))

    def end(self, spec: LaunchSpec, plan: Plan) -> LaunchEnd:
        if spec.hostfile is None:
            return plan.end
        end = plan.end
        assert end.run_folder is not None
        end.run_folder.mkdir(parents=True, exist_ok=True)
        if spec.job_id:
            return end
        # Outside a scheduler's job the launch is recorded as a `local` job (its pid); inside one
        # (a PBS script passes its job id) the submission is recorded already.
        return LaunchEnd(end.run_folder, record_this_launch(end.run_folder, self.node_count(spec) * spec.nproc,
                                                           spec.command_line))

    def refused(self, spec: LaunchSpec) -> None:
        if spec.hostfile is not None and spec.job_id:  # the PBS job's end, for `--wait` and `status`
            LaunchEnd(spec.run_folder, spec.job_id)(Decision(restart=False, status=ExitStatus.FAILED))

    def describe(self, spec: LaunchSpec, attempts: Attempts) -> str:
        return attempts.describe() if spec.hostfile is not None else super().describe(spec, attempts)

    def describe_nodes(self, spec: LaunchSpec) -> str:
        return (f"; one node supervisor per node, around the recovery store this launch serves (${RECOVERY_STORE_VAR}, "
                "a fresh one each attempt)" if spec.recovery is not None else "")

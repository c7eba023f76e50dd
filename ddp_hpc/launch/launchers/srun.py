"""``--launcher srun``: one srun step per attempt inside a SLURM allocation (``srun.SrunSteps``):
``--nodes`` of its nodes, ``--nproc`` ranks each (or one torchrun per node, ``--torchrun``);
its other nodes are spares a restart takes in place of a node where a rank failed. At the end
the job is requeued after a stop (``--requeue``) or its exit status written (``srun.srun_end``)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ddp_hpc.contract import RUN_FOLDER_VAR
from ddp_hpc.contract.slurm_job_key import JOB_ID_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.launch.attempts import Attempts, MarkedAttempts
from ddp_hpc.launch.launchers.base import Launcher, Plan, SignalTable
from ddp_hpc.launch.local import rank_command
from ddp_hpc.launch.node import NodeSupervisors, node_supervisor_command, store_host
from ddp_hpc.launch.restart import LaunchEnd
from ddp_hpc.launch.srun import NODE_COUNT_VAR, SrunLaunch, SrunSteps, TorchrunAgents, srun_end
from ddp_hpc.stop import StopSignal

if TYPE_CHECKING:
    from ddp_hpc.launch.spec import LaunchSpec


@dataclass(frozen=True)
class SrunLauncher(Launcher):
    name: ClassVar[str] = "srun"
    listed_at: ClassVar[int] = 50

    def check_here(self, spec: LaunchSpec) -> None:
        if spec.folder is None:
            raise UserError(f"--launcher srun needs --run-folder DIR (or ${RUN_FOLDER_VAR}): where the launch "
                            "records its exit status and the nodes it leaves out")
        if spec.allocated is None:
            raise UserError(f"--launcher srun runs inside a SLURM allocation (sbatch, salloc): "
                            f"${NODE_COUNT_VAR} is not set")

    def node_count(self, spec: LaunchSpec) -> int:
        if spec.nodes is None and spec.allocated is not None:
            return spec.allocated
        return super().node_count(spec)

    def ranks_here(self, spec: LaunchSpec) -> bool:
        return False

    def check_placement(self, spec: LaunchSpec) -> None:
        nodes = self.node_count(spec)
        if nodes < 1:
            raise UserError(f"--nodes {nodes} must be >= 1")
        assert spec.allocated is not None
        if nodes > spec.allocated:
            raise UserError(f"--nodes {nodes}: the allocation has {spec.allocated} node(s)")
        if spec.torchrun is not None:
            if spec.recovery is not None:
                raise UserError("--torchrun and --recover: torchrun's agents restart every rank on a failure; "
                                "in-job recovery starts its own node supervisors (give one of them)")
            if ":" not in spec.torchrun:
                raise UserError(f"--torchrun {spec.torchrun!r}: give the rendezvous endpoint as HOST:PORT")

    def plan(self, spec: LaunchSpec, folder: Path | None) -> Plan:
        assert folder is not None and spec.allocated is not None
        environ, limits = os.environ, spec.recovery
        run_folder = folder.resolve()
        nodes = self.node_count(spec)
        if limits is None:
            torchrun = TorchrunAgents(spec.torchrun, environ.get(JOB_ID_VAR, "")) if spec.torchrun else None
            srun = SrunLaunch(nodes, spec.nproc, tuple(rank_command(spec.command)), run_folder, spec.allocated,
                              torchrun)
        else:  # each task is one node's supervisor, which starts --nproc ranks there
            srun = SrunLaunch(nodes, 1, tuple(node_supervisor_command(spec.nproc, limits, spec.command)),
                              run_folder, spec.allocated)
        attempts: Attempts = MarkedAttempts(SrunSteps(srun), run_folder)
        if limits is not None:
            attempts = NodeSupervisors(attempts, host=store_host(environ, local=nodes == 1))
        return Plan(attempts, None, srun_end(run_folder, environ, requeue=spec.requeue))

    def stop_signals(self, spec: LaunchSpec) -> SignalTable:
        """Under srun, scancel's SIGTERM ends the launch; the stop is the batch script's
        ``--signal`` (``--stop-signal``), which srun passes on as SIGUSR2 to one task per rank;
        torchrun agents take SIGTERM (through scancel)."""
        stop = StopSignal.default().signal if spec.stop_signal is None else spec.stop_signal
        passed = signal.SIGTERM if spec.torchrun is not None else signal.SIGUSR2
        return {signal.SIGTERM: None, signal.SIGHUP: None, stop: passed}

    def end(self, spec: LaunchSpec, plan: Plan) -> LaunchEnd:
        assert plan.end.run_folder is not None
        plan.end.run_folder.mkdir(parents=True, exist_ok=True)
        return plan.end

    def describe(self, spec: LaunchSpec, attempts: Attempts) -> str:
        return attempts.describe()

"""``launch(spec)``: ``ddp-hpc launch``, every mode, in one place.

From a checked ``LaunchSpec`` (launch/spec.py): the mode's ``Attempts`` (launch/attempts.py),
wrapped where the mode needs it (``MarkedAttempts``: each attempt's ``Outcome``, launch/outcome.py;
``NodeSupervisors``: a node supervisor per node around the recovery store); the one
``Supervisor`` over them under the one ``RestartPolicy``; the one table of which signal is a
stop and what the launcher passes on (``stop_signals``); and the one end action
(``restart.LaunchEnd``: the exit file, or the requeue).

Library code: the CLI hands in the function that installs a signal handler (``signal.signal``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_hpc.contract import RECOVERY_STORE_VAR, RESTART_COUNT_VAR, RUN_FOLDER_VAR, SNAPSHOT_DIR_VAR, ExitStatus
from ddp_hpc.errors import UserError
from ddp_hpc.launch import supervisor as supervisors
from ddp_hpc.launch.attempts import Attempts, MarkedAttempts
from ddp_hpc.launch.hosts import HostfileAttempts, HostLaunch, record_this_launch, recovery_store_host
from ddp_hpc.launch.local import LocalRanks, mpiexec_here, rank_command
from ddp_hpc.launch.mpi import STOP_PASSED_ON, STOP_STATUS_LOST
from ddp_hpc.launch.node import NodeSupervisors, node_place, node_supervisor_command, rank_base_environment, store_host
from ddp_hpc.launch.recovering import Recoverer
from ddp_hpc.launch.restart import Decision, LaunchEnd, RestartPolicy
from ddp_hpc.launch.spec import LaunchSpec
from ddp_hpc.launch.srun import SrunLaunch, SrunSteps, TorchrunAgents, srun_end
from ddp_hpc.contract.slurm_job_key import JOB_ID_VAR
from ddp_hpc.stop import StopSignal

#: Installs a signal handler: ``signal.signal``, handed in by the CLI.
InstallHandler = Callable[[int, Callable[[int, Any], None]], Any]


@dataclass(frozen=True)
class Plan:
    """What runs a launch: its attempts, the recovery inside them where the launch itself
    recovers (a ``Recoverer``), and its end."""

    attempts: Attempts
    in_job: Recoverer | None
    end: LaunchEnd


def launch(spec: LaunchSpec, install_handler: InstallHandler) -> int:
    """Run the launch; its exit status (0, 75 after a stop, else the failure's)."""
    try:
        with _scratch_folder(spec) as folder:
            plan = plan_launch(spec, folder)
            if spec.dry_run:
                print(_describe(spec, plan.attempts), end="")
                return 0
            with _snapshot_folder(spec):
                return _run(spec, plan, install_handler)
    except (UserError, OSError):
        if spec.mode == "hosts" and spec.job_id:  # the PBS job's end, for `--wait` and `status`
            LaunchEnd(spec.run_folder, spec.job_id)(Decision(restart=False, status=ExitStatus.FAILED))
        raise


@contextlib.contextmanager
def _scratch_folder(spec: LaunchSpec) -> Iterator[Path | None]:
    """The launch's run folder; under mpiexec here without one, a folder of its own, where
    the ranks say they stopped: the launcher's status may lose their 75 (``mpi.STOP_STATUS_LOST``)."""
    if spec.mode == "here" and spec.launcher in STOP_STATUS_LOST and spec.folder is None:
        with tempfile.TemporaryDirectory(prefix="ddp-hpc-launch-") as scratch:
            yield Path(scratch)
    else:
        yield spec.folder


@contextlib.contextmanager
def _snapshot_folder(spec: LaunchSpec) -> Iterator[None]:
    """Under ``--recover``: one folder on node-local memory for the whole launch, where the
    ranks keep a sharded model's snapshots (``engine/recovery/shards.py``), the same path on
    every node and in every attempt (a restart in place reads it), removed from this node
    when the launch ends (the ranks remove their copies when training ends; a job that
    fails for good on several nodes leaves the other nodes' to the site's clean-up of
    ``/dev/shm``). The ranks find it in ``$DDP_HPC_SNAPSHOT_DIR`` (under the user's, if set)."""
    if spec.recovery is None or spec.mode == "node":  # a node supervisor's ranks use its launch's
        yield
        return
    base = os.environ.get(SNAPSHOT_DIR_VAR) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    folder = Path(base) / f"ddp_hpc-launch-{socket.gethostname()}-{os.getpid()}"
    before = os.environ.get(SNAPSHOT_DIR_VAR)
    os.environ[SNAPSHOT_DIR_VAR] = str(folder)  # every launcher hands the launch's environment on
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if before is None:
            os.environ.pop(SNAPSHOT_DIR_VAR, None)
        else:
            os.environ[SNAPSHOT_DIR_VAR] = before


def plan_launch(spec: LaunchSpec, folder: Path | None) -> Plan:
    """The mode's attempts and end (``folder``: the run folder, or the scratch one)."""
    environ = os.environ
    limits = spec.recovery
    if spec.mode == "node":
        address = spec.store_address
        node_rank, nodes = node_place(environ)
        ranks = LocalRanks(spec.nproc, rank_command(spec.command), base_env=rank_base_environment(environ),
                           node_rank=node_rank, num_nodes=nodes, master_addr=address.rpartition(":")[0])
        assert limits is not None
        recoverer = Recoverer(ranks, limits, store_address=address,
                              outer_attempt=int(environ.get(RESTART_COUNT_VAR, "0") or 0))
        return Plan(recoverer, recoverer, LaunchEnd())
    if spec.mode == "hosts":
        assert spec.run_folder is not None
        hosts = HostLaunch(spec.launcher, spec.hosts, spec.node_count, spec.nproc, spec.command, spec.run_folder,
                           spec.max_restarts, host_suffix=spec.host_suffix or "", program=spec.mpiexec,
                           cpu_bind=spec.cpu_bind, depth=spec.depth, recovery=limits)
        attempts: Attempts = MarkedAttempts(HostfileAttempts(hosts), spec.run_folder)
        if limits is not None:
            attempts = NodeSupervisors(attempts, host=recovery_store_host(hosts, environ))
        return Plan(attempts, None, LaunchEnd(spec.run_folder, spec.job_id or ""))
    if spec.mode == "srun":
        assert folder is not None and spec.allocated is not None
        run_folder = folder.resolve()
        nodes = spec.node_count
        if limits is None:
            torchrun = TorchrunAgents(spec.torchrun, environ.get(JOB_ID_VAR, "")) if spec.torchrun else None
            srun = SrunLaunch(nodes, spec.nproc, tuple(rank_command(spec.command)), run_folder, spec.allocated,
                              torchrun)
        else:  # each task is one node's supervisor, which starts --nproc ranks there
            srun = SrunLaunch(nodes, 1, tuple(node_supervisor_command(spec.nproc, limits, spec.command)),
                              run_folder, spec.allocated)
        attempts = MarkedAttempts(SrunSteps(srun), run_folder)
        if limits is not None:
            attempts = NodeSupervisors(attempts, host=store_host(environ, local=nodes == 1))
        return Plan(attempts, None, srun_end(run_folder, environ, requeue=spec.requeue))
    # here: the ranks as children of this launch, or one mpiexec
    mpiexec = spec.launcher != "local"
    in_job = None
    if not mpiexec:
        attempts = LocalRanks(spec.nproc, rank_command(spec.command))
        if limits is not None:
            attempts = in_job = Recoverer(attempts, limits)
    elif limits is None:
        attempts = mpiexec_here(spec.launcher, spec.nproc, rank_command(spec.command), folder)
    else:  # one mpiexec task: the node supervisor, which starts the ranks
        attempts = NodeSupervisors(mpiexec_here(
            spec.launcher, 1, node_supervisor_command(spec.nproc, limits, spec.command), folder,
            forward=(RECOVERY_STORE_VAR, RESTART_COUNT_VAR, RUN_FOLDER_VAR, SNAPSHOT_DIR_VAR)))
    if folder is not None and (mpiexec or spec.run_folder is not None):
        attempts = MarkedAttempts(attempts, folder)  # mpiexec's status through the marker
    # A `submit local` script exec's this launch: the job id is its pid.
    return Plan(attempts, in_job, LaunchEnd(spec.run_folder, str(os.getpid())) if spec.run_folder else LaunchEnd())


def stop_signals(spec: LaunchSpec) -> dict[int, int | None]:
    """The one signal table: each signal the launch handles -> the stop the supervisor passes
    on (to the ranks through the launcher, or to node supervisors through the recovery
    store, as it came), or None: not a stop, the launch ends as on Ctrl-C (a closed terminal;
    under srun, scancel's SIGTERM)."""
    nodes = spec.recovery is not None and spec.mode != "node" and (spec.mode != "here" or spec.launcher != "local")
    if spec.mode == "srun":
        stop = (StopSignal.default().signal if spec.stop_signal is None else spec.stop_signal)
        # srun passes SIGUSR2 on to one task per rank; torchrun agents take SIGTERM (through scancel).
        passed = signal.SIGTERM if spec.torchrun is not None else signal.SIGUSR2
        return {signal.SIGTERM: None, signal.SIGHUP: None, stop: passed}
    stops = {signal.SIGUSR2, signal.SIGTERM}
    if spec.mode == "hosts" and spec.stop_signal is not None:  # a PBS script's --stop-signal
        stops.add(spec.stop_signal)
    through = None if nodes or spec.mode == "node" else STOP_PASSED_ON.get(spec.launcher)
    return {signal.SIGHUP: None, **{signum: through or signum for signum in stops}}


def _run(spec: LaunchSpec, plan: Plan, install_handler: InstallHandler) -> int:
    end = plan.end
    if spec.mode in ("hosts", "srun"):
        assert end.run_folder is not None
        end.run_folder.mkdir(parents=True, exist_ok=True)
    if spec.mode == "hosts" and not spec.job_id:
        # Outside a scheduler's job the launch is recorded as a `local` job (its pid); inside one
        # (a PBS script passes its job id) the submission is recorded already.
        end = LaunchEnd(end.run_folder, record_this_launch(end.run_folder, spec.node_count * spec.nproc,
                                                           spec.command_line))
    sys.stdout.flush()
    attempts = plan.attempts
    policy = RestartPolicy(0 if spec.mode == "node" else spec.max_restarts)  # a node's: the outer launch's
    supervisor = supervisors.Supervisor(attempts.start, policy, in_job=plan.in_job,
                                        read_status=attempts.read_status, forward_stop=attempts.forward_stop)
    if spec.mode == "node" and plan.in_job is not None:
        plan.in_job.on_stop = supervisor.request_stop  # a stop the outer launch asked for through the store
    for signum, passed_on in stop_signals(spec).items():
        install_handler(signum, _handler(supervisor, passed_on))
    return end(supervisor.run_to_decision())


def _handler(supervisor: Any, passed_on: int | None) -> Callable[[int, Any], None]:
    def stop(signum: int, frame: Any) -> None:
        if passed_on is None:
            raise KeyboardInterrupt
        supervisor.request_stop(passed_on)

    return stop


def _describe(spec: LaunchSpec, attempts: Attempts) -> str:
    """``--dry-run``: what each attempt starts (on this machine: and the restarts)."""
    if spec.mode != "here":
        return attempts.describe()
    nodes = (f"; one node supervisor per node, around the recovery store this launch serves (${RECOVERY_STORE_VAR}, "
             "a fresh one each attempt)" if spec.recovery is not None and spec.launcher != "local" else "")
    return (f"# at most {spec.max_restarts} restart(s) after a failure, none after a stop (75){nodes}\n"
            f"{attempts.describe()}")


"""``launch(spec)``: ``ddp-hpc launch``, every launcher, in one place.

From a checked ``LaunchSpec`` (launch/spec.py), whose launcher object (launch/launchers/)
says the rest: its ``Plan`` (the ``Attempts``, launch/attempts.py, wrapped where it needs:
``MarkedAttempts``, each attempt's ``Outcome``; ``NodeSupervisors``, a node supervisor per
node around the recovery store), its signal table (which signal is a stop and what it passes
on) and its end (``restart.LaunchEnd``: the exit file, or the requeue). Here: the one
``Supervisor`` over the attempts under the one ``RestartPolicy``, the handlers, the folders.

Library code: the CLI hands in the function that installs a signal handler (``signal.signal``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddp_hpc.contract import SNAPSHOT_DIR_VAR
from ddp_hpc.errors import UserError
from ddp_hpc.launch import supervisor as supervisors
from ddp_hpc.launch.launchers.base import Plan, SignalTable
from ddp_hpc.launch.restart import RestartPolicy
from ddp_hpc.launch.spec import LaunchSpec

__all__ = ["Plan", "launch", "plan_launch", "stop_signals"]

#: Installs a signal handler: ``signal.signal``, handed in by the CLI.
InstallHandler = Callable[[int, Callable[[int, Any], None]], Any]


def launch(spec: LaunchSpec, install_handler: InstallHandler) -> int:
    """Run the launch; its exit status (0, 75 after a stop, else the failure's)."""
    try:
        with _scratch_folder(spec) as folder:
            plan = plan_launch(spec, folder)
            if spec.dry_run:
                print(spec.chosen.describe(spec, plan.attempts), end="")
                return 0
            with _snapshot_folder(spec):
                return _run(spec, plan, install_handler)
    except (UserError, OSError):
        spec.chosen.refused(spec)
        raise


@contextlib.contextmanager
def _scratch_folder(spec: LaunchSpec) -> Iterator[Path | None]:
    """The launch's run folder; under mpiexec here without one, a folder of its own, where
    the ranks say they stopped: the launcher's status may lose their 75 (``Launcher.needs_scratch_folder``)."""
    if spec.folder is None and spec.chosen.needs_scratch_folder(spec):
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
    if spec.recovery is None or not spec.chosen.keeps_snapshot_folder(spec):
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
    """The launcher's attempts and end (``folder``: the run folder, or the scratch one)."""
    return spec.chosen.plan(spec, folder)


def stop_signals(spec: LaunchSpec) -> SignalTable:
    """The one signal table: each signal the launch handles -> the stop the supervisor passes
    on, or None: not a stop, the launch ends as on Ctrl-C (a closed terminal; under srun,
    scancel's SIGTERM). The launcher's (``Launcher.stop_signals``)."""
    return spec.chosen.stop_signals(spec)


def _run(spec: LaunchSpec, plan: Plan, install_handler: InstallHandler) -> int:
    end = spec.chosen.end(spec, plan)
    sys.stdout.flush()
    attempts = plan.attempts
    policy = RestartPolicy(spec.chosen.restarts(spec))
    supervisor = supervisors.Supervisor(attempts.start, policy, in_job=plan.in_job,
                                        read_status=attempts.read_status, forward_stop=attempts.forward_stop)
    spec.chosen.attach(plan, supervisor)
    for signum, passed_on in stop_signals(spec).items():
        install_handler(signum, _handler(supervisor, passed_on))
    return end(supervisor.run_to_decision())


def _handler(supervisor: Any, passed_on: int | None) -> Callable[[int, Any], None]:
    def stop(signum: int, frame: Any) -> None:
        if passed_on is None:
            raise KeyboardInterrupt
        supervisor.request_stop(passed_on)

    return stop

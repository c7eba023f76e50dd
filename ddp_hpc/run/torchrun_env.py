"""``ddp-hpc run``: give any command the environment torchrun gives its workers.

A script written for torchrun (``init_process_group(backend)`` with the default ``env://``,
``LOCAL_RANK`` for the device) and frameworks that detect torchrun (Lightning's
``TorchElasticEnvironment`` needs RANK, GROUP_RANK, LOCAL_RANK and LOCAL_WORLD_SIZE;
``torch.distributed.is_torchelastic_launched()`` looks at TORCHELASTIC_RUN_ID) then run
unmodified under mpiexec, srun or a PBS script. The variable names and values follow
``LocalElasticAgent._start_workers`` in torch/distributed/elastic/agent/server/.

Everything here is pure: the CLI resolves, calls ``worker_environment`` and ``exec``s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ddp_hpc.contract import BACKEND_VAR, DEVICE_VAR, RESTART_COUNT_VAR
from ddp_hpc.engine.collectives import flight_recorder_variables
from ddp_hpc.environment import DistEnv, detect_launcher
from ddp_hpc.environment.launchers import TorchrunEnvironment
from ddp_hpc.errors import TooFewDevicesError, UserError

if TYPE_CHECKING:  # ddp_hpc.device is imported where a device is chosen (command_environment)
    from ddp_hpc.device import DeviceChoice, HostDevices

log = logging.getLogger(__name__)

#: The role name torchrun gives workers when none is asked for (``--role``).
ROLE_NAME = "default"


@dataclass(frozen=True)
class WorkerLaunch:
    """What ``ddp-hpc run`` executes: the command and the variables it adds."""

    argv: tuple[str, ...]
    #: The variables set for the command (the rest of the environment passes through).
    exported: Mapping[str, str]

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        return {**base, **self.exported}


def torchrun_variables(dist_env: DistEnv, run_id: str, restart_count: int = 0) -> dict[str, str]:
    """The variables torchrun's elastic agent exports to each worker, from our resolution."""
    return {
        "RANK": str(dist_env.rank),
        "WORLD_SIZE": str(dist_env.world_size),
        "LOCAL_RANK": str(dist_env.local_rank),
        "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
        "GROUP_RANK": str(dist_env.node_rank),
        "GROUP_WORLD_SIZE": str(dist_env.num_nodes),
        "ROLE_RANK": str(dist_env.rank),
        "ROLE_WORLD_SIZE": str(dist_env.world_size),
        "ROLE_NAME": ROLE_NAME,
        "MASTER_ADDR": dist_env.master_addr,
        "MASTER_PORT": str(dist_env.master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # No agent serves a store here: rank 0 of the command serves it (env:// does this).
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def omp_threads(local_world_size: int, environ: Mapping[str, str], cpus_visible: int) -> int:
    """Threads per rank when OMP_NUM_THREADS is unset, so ranks sharing a node do not
    oversubscribe it (torchrun sets 1; a fair share of the CPUs is as safe and faster).

    A launcher that already bound this rank to its own CPUs (srun's ``--cpus-per-task``,
    PALS ``--depth``) leaves fewer CPUs visible than the node has: then all of them are
    this rank's.
    """
    per_task = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if per_task.isdigit() and int(per_task) > 0:
        return int(per_task)
    total = os.cpu_count() or cpus_visible
    if cpus_visible < total:
        return max(1, cpus_visible)
    return max(1, cpus_visible // max(local_world_size, 1))


def visible_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_id_for(dist_env: DistEnv, launch_id: str | None) -> str:
    """A string every rank of this launch shares (torchrun's ``--rdzv-id``): the launcher's
    ``launch_id``, else rank 0's address."""
    return launch_id or f"{dist_env.master_addr}:{dist_env.master_port}"


def worker_environment(command: Sequence[str], dist_env: DistEnv, choice: DeviceChoice | None,
                       environ: Mapping[str, str], *, cpus: int | None = None) -> WorkerLaunch:
    """The command and what to export for it on this rank (``choice`` None: no device or
    backend is exported, the command picks its own).

    Under torchrun only the flight recorder is switched on (so that a watchdog can tell
    which collective each rank is at): its workers already have every other variable.
    """
    if not command:
        raise UserError("no command to run: give it after '--', e.g. ddp-hpc run -- python train.py")
    if dist_env.source == TorchrunEnvironment.name:
        return WorkerLaunch(tuple(command), flight_recorder_variables(environ))
    restart = environ.get(RESTART_COUNT_VAR, "0").strip() or "0"
    if not restart.isdigit():
        raise UserError(f"environment variable {RESTART_COUNT_VAR}={restart!r} is not a whole number")
    # torchrun's workers see the restart as TORCHELASTIC_RESTART_COUNT too.
    launch_id = detect_launcher(environ).launch_id(environ)
    exported = torchrun_variables(dist_env, run_id_for(dist_env, launch_id), int(restart))
    if choice is not None:
        exported[DEVICE_VAR] = choice.device_type
        exported[BACKEND_VAR] = choice.backend
    exported.update(flight_recorder_variables(environ))
    from ddp_hpc.device import NCCL_ERROR_HANDLING_VAR  # imported already: the choice was made there

    if NCCL_ERROR_HANDLING_VAR not in environ:
        exported[NCCL_ERROR_HANDLING_VAR] = "1"
    if not environ.get("OMP_NUM_THREADS", "").strip():
        exported["OMP_NUM_THREADS"] = str(omp_threads(dist_env.local_world_size, environ,
                                                      cpus if cpus is not None else visible_cpus()))
    return WorkerLaunch(tuple(command), exported)


def command_environment(command: Sequence[str], *, device: str | None = None, backend: str | None = None,
                        host_suffix: str | None = None, environ: Mapping[str, str] | None = None,
                        host: HostDevices | None = None) -> WorkerLaunch:
    """What ``ddp-hpc run -- COMMAND`` executes on this rank: the command and the torchrun
    worker variables to export for it (nothing under torchrun itself). torch is imported only
    where the host has a GPU or the request names one (``device.probe_host``): the command
    imports it anyway.

    More ranks on the node than GPUs, with no device or backend asked for, is no mistake
    here: the command may share a GPU among its ranks over gloo (examples/recovering_loop.py
    with DEVICE=cuda). It is said once, and nothing about the device is exported; ddp_hpc's
    own process group in the command still refuses cuda with nccl there."""
    from ddp_hpc.device import probe_host, requested, select_device
    from ddp_hpc.environment import resolve_env
    from ddp_hpc.environment.fabric import check_fabric, this_host, where_label
    from ddp_hpc.environment.netcheck import check_network

    environ = os.environ if environ is None else environ
    dist_env = resolve_env(environ, host_suffix=host_suffix)
    wanted_device, wanted_backend = requested(device, environ, DEVICE_VAR), requested(backend, environ, BACKEND_VAR)
    where = where_label(dist_env.rank, dist_env.world_size)
    choice: DeviceChoice | None
    try:
        choice = select_device(wanted_device, wanted_backend, local_rank=dist_env.local_rank,
                               local_world_size=dist_env.local_world_size,
                               host=probe_host(wanted_device, wanted_backend) if host is None else host, env=environ)
    except TooFewDevicesError as exc:
        if (wanted_device, wanted_backend) != ("auto", "auto"):
            raise
        if dist_env.local_rank == 0:
            log.warning("%s: %s; nothing was asked for, so the command picks its own device (ranks can share a GPU "
                        "over gloo)", where, exc)
        choice = None
    backend = choice.backend if choice is not None else "gloo"  # the one backend ranks sharing a GPU can use
    # Before the command starts: it would wait for the other ranks before failing on a bad
    # interface or plugin name.
    check_fabric(backend, environ, this_host(environ), where=where)
    launch = worker_environment(command, dist_env, choice, environ)
    if dist_env.world_size > 1 and launch.exported:
        # The same checks as before ddp_hpc's own rendezvous: a loopback host name across
        # machines is refused, and a host suffix picks gloo's interface for the command too.
        network = check_network(dist_env, backend, host_suffix=host_suffix, environ=environ)
        if network.gloo_ifname and not environ.get("GLOO_SOCKET_IFNAME"):
            launch = replace(launch, exported={**launch.exported, "GLOO_SOCKET_IFNAME": network.gloo_ifname})
    return launch

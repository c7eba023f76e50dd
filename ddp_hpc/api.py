"""The public Python API: what the CLI does, as functions over typed values.

Imported lazily through ``ddp_hpc.<name>`` (see ``ddp_hpc/__init__.py``); documented in
docs/api.md. None of these functions installs signal handlers, configures logging or ends
the process: those belong to the program that owns the process (the CLI is one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace

from ddp_hpc.contract import BACKEND_VAR, DEVICE_VAR
from ddp_hpc.device import requested, select_device
from ddp_hpc.distributed import DistContext, DistributedOptions
from ddp_hpc.distributed import process_group as _process_group
from ddp_hpc.environment import DistEnv
from ddp_hpc.environment import resolve_env as _resolve_env
from ddp_hpc.environment.fabric import check_fabric, this_host, where_label
from ddp_hpc.environment.netcheck import check_network
from ddp_hpc.torchrun_env import WorkerLaunch, worker_environment


def resolve_env(environ: Mapping[str, str] | None = None, *, host_suffix: str | None = None) -> DistEnv:
    """Where this process sits in the job (rank, sizes, node, rank 0's address and port),
    from the launcher's variables alone: no process group is started.

    Raises ``UserError`` when the variables are malformed or two launchers disagree.
    """
    return _resolve_env(environ, host_suffix=host_suffix)


@contextmanager
def process_group(device: str | None = None, backend: str | None = None, *, timeout_s: float = 600.0,
                  host_suffix: str | None = None,
                  environ: Mapping[str, str] | None = None) -> Iterator[DistContext]:
    """Start the process group for this rank, yield its ``DistContext``, always tear it down.

    ``device``/``backend`` default to ``$DDP_HPC_DEVICE``/``$DDP_HPC_BACKEND``, else auto
    (xpu, then cuda, then cpu). With one process no group is created and the context's
    collectives work locally, so the same script runs on a laptop.
    """
    options = DistributedOptions(device=device, backend=backend, timeout_s=timeout_s, host_suffix=host_suffix)
    with _process_group(options, environ) as ctx:
        yield ctx


def command_environment(command: Sequence[str], *, device: str | None = None, backend: str | None = None,
                        host_suffix: str | None = None,
                        environ: Mapping[str, str] | None = None) -> WorkerLaunch:
    """What ``ddp-hpc run -- COMMAND`` executes on this rank: the command and the torchrun
    worker variables to export for it (nothing under torchrun itself)."""
    environ = os.environ if environ is None else environ
    dist_env = _resolve_env(environ, host_suffix=host_suffix)
    choice = select_device(requested(device, environ, DEVICE_VAR),
                           requested(backend, environ, BACKEND_VAR),
                           local_rank=dist_env.local_rank, local_world_size=dist_env.local_world_size,
                           env=environ)
    # Before the command starts: it would wait for the other ranks before failing on a bad
    # interface or plugin name.
    check_fabric(choice.backend, environ, this_host(environ),
                 where=where_label(dist_env.rank, dist_env.world_size))
    launch = worker_environment(command, dist_env, choice, environ)
    if dist_env.world_size > 1 and launch.exported:
        # The same checks as before ddp_hpc's own rendezvous: a loopback host name across
        # machines is refused, and a host suffix picks gloo's interface for the command too.
        network = check_network(dist_env, choice.backend, host_suffix=host_suffix, environ=environ)
        if network.gloo_ifname and not environ.get("GLOO_SOCKET_IFNAME"):
            launch = replace(launch, exported={**launch.exported, "GLOO_SOCKET_IFNAME": network.gloo_ifname})
    return launch

"""The public Python API: what the CLI does, as functions over typed values.

Imported lazily through ``ddp_hpc.<name>`` (see ``ddp_hpc/__init__.py``); documented in
docs/api.md. None of these functions installs signal handlers, configures logging or ends
the process: those belong to the program that owns the process (the CLI is one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ddp_hpc.startup.distributed import DistContext, DistributedOptions
from ddp_hpc.startup.distributed import process_group as _process_group
from ddp_hpc.environment import DistEnv
from ddp_hpc.environment import resolve_env as _resolve_env
from ddp_hpc.run.torchrun_env import command_environment  # noqa: F401  (public: ddp_hpc.command_environment)


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



"""The ``local`` family, the minimal example of a whole scheduler family: ``backend.py``
renders a bash script and runs it on this machine (docs/architecture.md walks through it)."""

from ddp_hpc.schedulers.local.backend import LocalScheduler

__all__ = ["LocalScheduler"]

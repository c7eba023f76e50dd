"""The ``local`` family, the minimal example of a whole scheduler family: ``backend.py``
renders a bash script and runs it on this machine, and ``FAMILY`` below, its entry point
(docs/architecture.md walks through it)."""

from ddp_hpc.schedulers.base import SchedulerFamily
from ddp_hpc.schedulers.local.backend import PROFILE_SCHEDULERS, LocalScheduler

#: The family, as pyproject.toml registers it (``ddp_hpc.schedulers`` entry points): this
#: machine, so always the ``local`` profile.
FAMILY = SchedulerFamily("local", (LocalScheduler,), default_profile="local", listed_at=30,
                         old_names=tuple(name for name in PROFILE_SCHEDULERS if name != "local"))

__all__ = ["FAMILY", "LocalScheduler"]

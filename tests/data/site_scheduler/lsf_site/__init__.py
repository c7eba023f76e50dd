"""A site's scheduler family for ddp_hpc, from outside the package (a test fixture): a fake LSF.
``backend.py`` renders a ``#BSUB`` script and submits it with ``bsub``; ``FAMILY`` is what the
``ddp_hpc.schedulers`` entry point names."""

from ddp_hpc.schedulers.base import SchedulerFamily
from lsf_site.backend import LsfScheduler

FAMILY = SchedulerFamily("lsf", (LsfScheduler,))

__all__ = ["FAMILY", "LsfScheduler"]

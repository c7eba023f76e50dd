"""A site's scheduler family for ddp_hpc, from outside the package (a test fixture): a fake LSF.
``backend.py`` renders a ``#BSUB`` script and submits it with ``bsub``; ``FAMILY`` is what the
``ddp_hpc.schedulers`` entry point names; ``job.py``'s ``LsfJob`` is its job as the job's processes see it
(the ``ddp_hpc.jobs`` entry point); ``probe.py``'s ``LsfReader`` reads its cluster for ``ddp-hpc cluster
probe|check|which``."""

from ddp_hpc.schedulers.base import SchedulerFamily
from lsf_site.backend import LsfScheduler
from lsf_site.job import LsfJob
from lsf_site.probe import LsfReader

FAMILY = SchedulerFamily("lsf", (LsfScheduler,), job=LsfJob(), reader=LsfReader())

__all__ = ["FAMILY", "LsfJob", "LsfScheduler"]

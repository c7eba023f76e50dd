"""The PBS family (PBS Pro, and Slurm's PBS wrappers): ``render.py`` writes the script
(pure), ``backend.py`` submits it with ``qsub`` and cancels with ``qdel``, ``state.py`` reads
``qstat`` and the exit file. Inside the job only the rendered script runs."""

from ddp_hpc.environment.jobs import PbsJob
from ddp_hpc.schedulers.base import SchedulerFamily
from ddp_hpc.schedulers.pbs.probe import PbsReader
from ddp_hpc.schedulers.pbs.backend import PbsScheduler

#: The family, as pyproject.toml registers it (``ddp_hpc.schedulers`` entry points).
FAMILY = SchedulerFamily("pbs", (PbsScheduler,), listed_at=10, job=PbsJob(), reader=PbsReader())

__all__ = ["FAMILY", "PbsScheduler"]

"""The SLURM family, two backends: ``sbatch.py`` submits the batch script ``render.py``
writes (srun per rank, or torchrun per node); ``submitit_backend.py`` submits Python
callables with submitit, which run ``in_job.py`` on every task. ``state.py`` reads sacct,
scontrol, squeue and the exit file. The array element id is ``contract/slurm_job_key.py``'s
(the launch uses it too); ``ddp-hpc launch --launcher srun`` is ``launch/srun.py``.
"""

from ddp_hpc.environment.jobs import SlurmJob
from ddp_hpc.schedulers.base import SchedulerFamily
from ddp_hpc.schedulers.slurm.probe import SlurmReader
from ddp_hpc.schedulers.slurm.sbatch import SbatchScheduler
from ddp_hpc.schedulers.slurm.submitit_backend import SubmititScheduler

#: The family, as pyproject.toml registers it (``ddp_hpc.schedulers`` entry points): submitit
#: by default, sbatch where a batch script is rendered or ``--sbatch`` given.
FAMILY = SchedulerFamily("slurm", (SubmititScheduler, SbatchScheduler), listed_at=20, job=SlurmJob(),
                         reader=SlurmReader())

__all__ = ["FAMILY", "SbatchScheduler", "SubmititScheduler"]

"""The SLURM family, two backends: ``sbatch.py`` submits the batch script ``render.py``
writes (srun per rank, or torchrun per node); ``submitit_backend.py`` submits Python
callables with submitit, which run ``in_job.py`` on every task. ``state.py`` reads sacct,
scontrol, squeue and the exit file; ``job_key.py`` is the one home of the array element id.
"""

from ddp_hpc.schedulers.slurm.sbatch import SbatchScheduler
from ddp_hpc.schedulers.slurm.submitit_backend import SubmititScheduler

__all__ = ["SbatchScheduler", "SubmititScheduler"]

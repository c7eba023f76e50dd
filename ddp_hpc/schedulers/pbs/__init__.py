"""The PBS family (PBS Pro, and Slurm's PBS wrappers): ``render.py`` writes the script
(pure), ``backend.py`` submits it with ``qsub`` and cancels with ``qdel``, ``state.py`` reads
``qstat`` and the exit file. Inside the job only the rendered script runs."""

from ddp_hpc.schedulers.pbs.backend import PbsScheduler

__all__ = ["PbsScheduler"]

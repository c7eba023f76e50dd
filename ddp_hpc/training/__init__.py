"""The training engine: a user's ``Job`` and the ``Trainer`` that runs it on every rank."""

from ddp_hpc.training.callbacks import Callback
from ddp_hpc.training.job import Datasets, Job, StepOutput

__all__ = ["Callback", "Datasets", "Job", "StepOutput"]

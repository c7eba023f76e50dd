"""ddp_hpc: PyTorch DDP from a laptop to a supercomputer.

The public API is the names in ``__all__``, imported lazily (``import ddp_hpc`` stays
cheap: torch is loaded on first use). docs/api.md describes each with an example.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ddp_hpc import _moved

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    # Where this rank is, and the process group
    "resolve_env": "ddp_hpc.api",
    "process_group": "ddp_hpc.api",
    "command_environment": "ddp_hpc.api",
    "DistEnv": "ddp_hpc.environment.base",
    "DistContext": "ddp_hpc.startup.distributed",
    # Training a Job with the Trainer
    "Config": "ddp_hpc.config",
    "load_config": "ddp_hpc.config",
    "Job": "ddp_hpc.training.job",
    "Datasets": "ddp_hpc.training.job",
    "StepOutput": "ddp_hpc.training.job",
    "train": "ddp_hpc.training.run_on_rank",
    "TrainOptions": "ddp_hpc.training.run_on_rank",
    "RunSummary": "ddp_hpc.summary",
    # Your own loop: resumable checkpoints, agreed stops, the watchdog, in-job recovery
    "Checkpointer": "ddp_hpc.engine.checkpointer",
    "ResumableSampler": "ddp_hpc.engine.sampler",
    "StopAgreement": "ddp_hpc.engine.stop_agreement",
    "record_stop_signals": "ddp_hpc.stop",
    "watchdog": "ddp_hpc.engine.watchdog",
    "InJobRecovery": "ddp_hpc.engine.recovery",
    "inspect_checkpoints": "ddp_hpc.engine.checkpoint_tools",
    "convert_checkpoint": "ddp_hpc.engine.checkpoint_tools",
    # Submitting to a scheduler
    "SubmitRequest": "ddp_hpc.specs.request",
    "submit": "ddp_hpc.schedulers.runner",
    "wait": "ddp_hpc.schedulers.runner",
    "UserError": "ddp_hpc.errors",
}

__all__ = ["__version__", *_EXPORTS]

#: Old public name -> its new name (still answered, with a DeprecationWarning).
_RENAMED = {"JobRequest": "SubmitRequest"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"ddp_hpc.{name} is now ddp_hpc.{_RENAMED[name]}", DeprecationWarning, stacklevel=2)
        return __getattr__(_RENAMED[name])
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddp_hpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


# The module paths of before issue 30's layout still import, with a DeprecationWarning.
_moved.install()


if TYPE_CHECKING:
    from ddp_hpc.api import command_environment, process_group, resolve_env
    from ddp_hpc.config import Config, load_config
    from ddp_hpc.startup.distributed import DistContext
    from ddp_hpc.engine.checkpoint_tools import convert_checkpoint, inspect_checkpoints
    from ddp_hpc.engine.checkpointer import Checkpointer
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.watchdog import watchdog
    from ddp_hpc.engine.sampler import ResumableSampler
    from ddp_hpc.engine.stop_agreement import StopAgreement
    from ddp_hpc.environment.base import DistEnv
    from ddp_hpc.errors import UserError
    from ddp_hpc.specs.request import SubmitRequest
    from ddp_hpc.stop import record_stop_signals
    from ddp_hpc.schedulers.runner import submit, wait
    from ddp_hpc.summary import RunSummary
    from ddp_hpc.training.run_on_rank import TrainOptions, train
    from ddp_hpc.training.job import Datasets, Job, StepOutput

"""ddp_hpc: PyTorch DDP from a laptop to a supercomputer.

The public API is the names in ``__all__``, imported lazily (``import ddp_hpc`` stays
cheap: torch is loaded on first use). docs/api.md describes each with an example.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING, Any

from ddp_hpc.version import __version__

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
    "Checkpointer": "ddp_hpc.engine.checkpoint.checkpointer",
    "ResumableSampler": "ddp_hpc.engine.sampler",
    "StopAgreement": "ddp_hpc.engine.stop_agreement",
    "record_stop_signals": "ddp_hpc.stop_handler",
    "watchdog": "ddp_hpc.engine.watchdog",
    "InJobRecovery": "ddp_hpc.engine.recovery",
    "seed_everything": "ddp_hpc.engine.rng",
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


#: Old module path -> the module that holds its code now (issue 30's layout). Still imported,
#: with a DeprecationWarning, by ``_OldPaths``; no file is left at an old path, so git follows
#: each moved file through history and merges.
_MOVED = {
    "ddp_hpc.torchrun_env": "ddp_hpc.run.torchrun_env",
    "ddp_hpc.python_command": "ddp_hpc.run.python_command",
    "ddp_hpc.distributed": "ddp_hpc.startup.distributed",
    "ddp_hpc.rendezvous": "ddp_hpc.startup.rendezvous",
    "ddp_hpc.fail_fast": "ddp_hpc.startup.fail_fast",
    "ddp_hpc.links": "ddp_hpc.startup.links",
    "ddp_hpc.doctor": "ddp_hpc.startup.doctor",
    "ddp_hpc.launch.request": "ddp_hpc.specs.request",
    "ddp_hpc.launch.profiles": "ddp_hpc.specs.profiles",
    "ddp_hpc.launch.sweep": "ddp_hpc.specs.sweep",
    "ddp_hpc.engine.recovery_store": "ddp_hpc.engine.recovery.store",
    "ddp_hpc.engine.recovery_record": "ddp_hpc.engine.recovery.record",
    "ddp_hpc.engine.recovery_backends": "ddp_hpc.engine.recovery.backends",
    "ddp_hpc.schedulers.slurm.step": "ddp_hpc.launch.srun",
    "ddp_hpc.schedulers.slurm.job_key": "ddp_hpc.contract.slurm_job_key",
    "ddp_hpc.engine.checkpointer": "ddp_hpc.engine.checkpoint.checkpointer",
    "ddp_hpc.engine.checkpoint_files": "ddp_hpc.engine.checkpoint.files",
    "ddp_hpc.engine.dcp_format": "ddp_hpc.engine.checkpoint.dcp_format",
    "ddp_hpc.engine.background_writer": "ddp_hpc.engine.checkpoint.background_writer",
    "ddp_hpc.engine.host_copy": "ddp_hpc.engine.checkpoint.host_copy",
}


class _OldPaths:
    """The import finder and loader of the paths in ``_MOVED``; last on ``sys.meta_path``, so
    asked only after no file was found. The module it makes takes every name from the new one."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, cls) if fullname in _MOVED else None

    @staticmethod
    def create_module(spec: Any) -> None:
        return None

    @staticmethod
    def exec_module(module: Any) -> None:
        new = importlib.import_module(_MOVED[module.__name__])
        # warnings skips the import machinery's frames: this names the line that imported the old path.
        warnings.warn(f"{module.__name__} is deprecated: import {new.__name__} instead", DeprecationWarning,
                      stacklevel=2)
        module.__doc__ = f"Deprecated: moved to {new.__name__}."
        module.__getattr__ = lambda name: getattr(new, name)


if _OldPaths not in sys.meta_path:
    sys.meta_path.append(_OldPaths)


if TYPE_CHECKING:
    from ddp_hpc.api import command_environment, process_group, resolve_env
    from ddp_hpc.config import Config, load_config
    from ddp_hpc.startup.distributed import DistContext
    from ddp_hpc.engine.checkpoint_tools import convert_checkpoint, inspect_checkpoints
    from ddp_hpc.engine.checkpoint.checkpointer import Checkpointer
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.watchdog import watchdog
    from ddp_hpc.engine.sampler import ResumableSampler
    from ddp_hpc.engine.stop_agreement import StopAgreement
    from ddp_hpc.environment.base import DistEnv
    from ddp_hpc.errors import UserError
    from ddp_hpc.specs.request import SubmitRequest
    from ddp_hpc.stop_handler import record_stop_signals
    from ddp_hpc.schedulers.runner import submit, wait
    from ddp_hpc.summary import RunSummary
    from ddp_hpc.training.run_on_rank import TrainOptions, train
    from ddp_hpc.training.job import Datasets, Job, StepOutput

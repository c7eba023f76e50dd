"""What the user owns: the model, the data, and what one step computes.

A job returns *per-sample* values from its steps (a loss and any metrics, each a tensor of
shape ``[batch]``). The engine sums them over ranks with padding removed, so each
validation sample counts exactly once whatever the world size; the reported metric is the
mean over samples.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_hpc.config_loader import ConfigError

Batch = Any


@dataclass
class Datasets:
    train: Dataset
    val: Dataset | None = None
    test: Dataset | None = None


@dataclass
class StepOutput:
    """One step's result. ``loss`` is what is back-propagated (a scalar, usually the batch
    mean); ``per_sample`` holds values of shape ``[batch]`` to average for the logs."""

    loss: torch.Tensor
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)


class Job(ABC):
    """Subclass this. ``params`` from the config's ``job.params`` arrive as keyword arguments."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model. Called with the same seed on every rank."""

    @abstractmethod
    def build_datasets(self) -> Datasets:
        """The datasets. Must be the same on every rank (each rank reads its own shard)."""

    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Default: ``(inputs, targets)`` batches and cross-entropy, with accuracy."""
        inputs, targets = batch
        logits = model(inputs)
        losses = nn.functional.cross_entropy(logits, targets, reduction="none")
        correct = (logits.argmax(dim=1) == targets).float()
        return StepOutput(losses.mean(), {"loss": losses.detach(), "accuracy": correct})

    def eval_step(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-sample values on held-out data; by default those of ``training_step``."""
        return self.training_step(model, batch).per_sample

    def move_batch(self, batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
        """Move a batch to ``device``; override for batches that are not tensors or tuples."""
        if isinstance(batch, torch.Tensor):
            return batch.to(device, non_blocking=non_blocking)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.move_batch(b, device, non_blocking) for b in batch)
        if isinstance(batch, Mapping):
            return {k: self.move_batch(v, device, non_blocking) for k, v in batch.items()}
        return batch


#: Short names for the jobs shipped in ``ddp_hpc/builtin_jobs/``.
REGISTRY = {
    "digits": "ddp_hpc.builtin_jobs.digits:DigitsJob",
    "synthetic": "ddp_hpc.builtin_jobs.synthetic:SyntheticJob",
    "preference": "ddp_hpc.builtin_jobs.preference:PreferenceJob",
}


def _module_from_file(path: Path, target: str, what: str) -> ModuleType:
    """A job module given by file path (``jobs/my_job.py:MyJob``), imported under its stem."""
    if not path.is_file():
        raise ConfigError(f"{what} {target!r}: no file {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"ddp_hpc_user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise ConfigError(f"{what} {target!r}: cannot import {str(path)!r} ({exc})") from None
    return module


def import_object(target: str, what: str) -> Any:
    """``package.module:Name``, ``package.module.Name`` or ``path/to/file.py:Name`` -> the object."""
    module_name, sep, attribute = target.rpartition(":") if target.count(":") else ("", "", "")
    if not sep:
        module_name, _, attribute = target.rpartition(".")
    if not module_name or not attribute:
        raise ConfigError(f"{what} {target!r} is not 'package.module:Name' or 'path/to/file.py:Name'")
    if module_name.endswith(".py"):
        module = _module_from_file(Path(module_name), target, what)
        return _attribute(module, module_name, attribute, target, what)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {target!r}: cannot import module {module_name!r} ({exc})") from None
    return _attribute(module, module_name, attribute, target, what)


def _attribute(module: ModuleType, module_name: str, attribute: str, target: str, what: str) -> Any:
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ConfigError(f"{what} {target!r}: module {module_name!r} has no {attribute!r}") from None


def create_job(name: str, params: Mapping[str, Any]) -> Job:
    """The job named in the config, built with its params; a ConfigError names what is wrong."""
    cls = import_object(REGISTRY.get(name, name), "job.name")
    if not (isinstance(cls, type) and issubclass(cls, Job)):
        raise ConfigError(f"job.name {name!r} is not a ddp_hpc Job subclass")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"job.params for {name!r}: {exc}") from None

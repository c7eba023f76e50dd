"""Hooks into the training loop, named in the config's ``callbacks`` list."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_hpc.config import CallbackConfig
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.training.job import import_object

if TYPE_CHECKING:
    from ddp_hpc.summary import RunSummary
    from ddp_hpc.training.trainer import Trainer


class Callback:
    """Override what you need; every hook runs on every rank."""

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer) -> None: ...

    def on_checkpoint_saved(self, trainer: Trainer, path: Path) -> None:
        """After rank 0 wrote ``path`` (called on rank 0 only)."""

    def on_epoch_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None: ...


def create_callbacks(configs: Sequence[CallbackConfig]) -> list[Callback]:
    callbacks = []
    for i, config in enumerate(configs):
        cls = import_object(config.target, f"callbacks[{i}].target")
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise ConfigError(f"callbacks[{i}].target {config.target!r} is not a ddp_hpc Callback")
        try:
            callbacks.append(cls(**config.params))
        except TypeError as exc:
            raise ConfigError(f"callbacks[{i}].params: {exc}") from None
    return callbacks

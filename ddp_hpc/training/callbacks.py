"""The one extension point of the Trainer: callbacks, built-in services and the user's alike.

The Trainer's periodic services (tracking, early stopping, the background prestage, the
weights check) are callbacks too (``training/services/``); a user's callbacks, named in the
config's ``callbacks`` list, get the same hooks. Every hook receives the Trainer, typed as
``TrainerView``: what a callback may read of it (so that nothing here imports the Trainer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddp_hpc.config import CallbackConfig
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.training.job import import_object

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from ddp_hpc.config import Config, TrainingConfig
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.sampler import ResumableSampler
    from ddp_hpc.engine.stop_agreement import StopAgreement
    from ddp_hpc.startup.distributed import DistContext
    from ddp_hpc.summary import RunSummary
    from ddp_hpc.training.job import Job
    from ddp_hpc.training.precision import Precision
    from ddp_hpc.training.run_folder import RunFolder
    from ddp_hpc.training.state import Progress, TrainingState


class TrainerView(Protocol):
    """What a callback may read of the Trainer its hooks receive (the ``Trainer`` is one)."""

    @property
    def job(self) -> Job: ...
    @property
    def config(self) -> Config: ...
    @property
    def training(self) -> TrainingConfig: ...
    @property
    def ctx(self) -> DistContext: ...
    @property
    def run(self) -> RunFolder: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def state(self) -> TrainingState: ...
    @property
    def stop(self) -> StopAgreement: ...
    @property
    def recovery(self) -> InJobRecovery | None: ...
    @property
    def joining(self) -> bool: ...
    @property
    def progress(self) -> Progress: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def ddp_model(self) -> nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def scaler(self) -> torch.amp.GradScaler: ...
    @property
    def ema(self) -> nn.Module | None: ...
    @property
    def sampler(self) -> ResumableSampler: ...
    @property
    def history(self) -> list[dict[str, Any]]: ...
    @property
    def steps_per_epoch(self) -> int: ...
    @property
    def loader(self) -> DataLoader: ...
    @property
    def pin_memory(self) -> bool: ...
    @property
    def effective_batch_size(self) -> int: ...

    def request_stop(self) -> None: ...

    def evaluate(self, dataset: Dataset) -> tuple[dict[str, float], int]: ...


@dataclass(frozen=True)
class Verdict:
    """What a callback makes of a validation: a best checkpoint, a stop."""

    improved: bool = False
    stop: bool = False


class Callback:
    """Override what you need; every hook runs on every rank.

    A callback whose ``state_key`` is set keeps state in every checkpoint under that key
    (``state_dict()`` when saving, ``load_state_dict()`` when resuming).
    """

    state_key: str | None = None

    def on_fit_start(self, trainer: TrainerView) -> None: ...

    def running(self, trainer: TrainerView) -> AbstractContextManager[None]:
        """Entered after ``on_fit_start``, left when training ends or raises (a service that
        holds a thread, say)."""
        return nullcontext()

    def on_progress(self, trainer: TrainerView, phase: str) -> None:
        """At every optimizer step, evaluation batch and checkpoint (``phase`` says which):
        cheap work only."""

    def on_step_end(self, trainer: TrainerView) -> None: ...

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float],
                          epoch: int) -> Verdict | None:
        """After the validation of ``epoch`` (counted from 1); may ask for a best checkpoint or a stop."""
        return None

    def on_checkpoint_saved(self, trainer: TrainerView, path: Path) -> None:
        """After rank 0 wrote ``path`` (called on rank 0 only)."""

    def on_epoch_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        """After the epoch's metrics row and its checkpoint."""

    def on_test_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None: ...

    def on_stopped(self, trainer: TrainerView) -> None:
        """The ranks stopped on request, their checkpoint saved: ``fit`` returns a preempted summary."""

    def on_fit_end(self, trainer: TrainerView, summary: RunSummary) -> None:
        """Training completed (or stopped early): ``summary`` is its result."""


class CallbackList:
    """Calls each hook on every callback, in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def stateful(self) -> dict[str, Callback]:
        """The callbacks that keep state in checkpoints, by their key."""
        keyed: dict[str, Callback] = {}
        for callback in self.callbacks:
            if callback.state_key is None:
                continue
            if callback.state_key in keyed:
                raise ConfigError(f"two callbacks keep their state under {callback.state_key!r}")
            keyed[callback.state_key] = callback
        return keyed

    def on_fit_start(self, trainer: TrainerView) -> None:
        for callback in self.callbacks:
            callback.on_fit_start(trainer)

    @contextmanager
    def running(self, trainer: TrainerView) -> Iterator[None]:
        with ExitStack() as stack:
            for callback in self.callbacks:
                stack.enter_context(callback.running(trainer))
            yield

    def on_progress(self, trainer: TrainerView, phase: str) -> None:
        for callback in self.callbacks:
            callback.on_progress(trainer, phase)

    def on_step_end(self, trainer: TrainerView) -> None:
        for callback in self.callbacks:
            callback.on_step_end(trainer)

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float], epoch: int) -> Verdict:
        verdicts = [callback.on_validation_end(trainer, metrics, epoch) for callback in self.callbacks]
        verdicts = [verdict for verdict in verdicts if verdict is not None]
        return Verdict(improved=any(v.improved for v in verdicts), stop=any(v.stop for v in verdicts))

    def on_checkpoint_saved(self, trainer: TrainerView, path: Path) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint_saved(trainer, path)

    def on_epoch_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.on_epoch_end(trainer, metrics)

    def on_test_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_test_end(trainer, metrics)

    def on_stopped(self, trainer: TrainerView) -> None:
        for callback in self.callbacks:
            callback.on_stopped(trainer)

    def on_fit_end(self, trainer: TrainerView, summary: RunSummary) -> None:
        for callback in self.callbacks:
            callback.on_fit_end(trainer, summary)


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

"""The job config: typed sections of a YAML file, plus ``key=value`` overrides.

docs/training.md lists every key with its default; the dataclasses below are the source
of that list. Values are checked here, before any rank starts work or writes a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ddp_hpc.config_loader import (
    ConfigError,
    apply_overrides,
    build,
    non_negative,
    positive,
    to_plain,
)
from ddp_hpc.contract import checkpoint_format_of
from ddp_hpc.errors import UserError
from ddp_hpc.stop import parse_stop_signal


@dataclass(frozen=True)
class JobConfig:
    #: A registry name (``digits``, ``synthetic``, ``preference``) or ``package.module:Class``.
    name: str = "digits"
    #: Keyword arguments for the job's constructor.
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    name: Literal["none", "cosine", "step"] = "none"
    #: Advance the schedule every optimizer ``step`` or every ``epoch``.
    interval: Literal["step", "epoch"] = "step"
    #: Linear warm-up length in intervals (cosine only).
    warmup: int = 0
    #: StepLR: multiply the LR by ``gamma`` every ``step_size`` intervals.
    step_size: int = 10
    gamma: float = 0.1
    #: Cosine: the LR decays to ``min_lr_ratio`` x the initial LR.
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        non_negative(self.warmup, "warmup")
        positive(self.step_size, "step_size")
        positive(self.gamma, "gamma")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class TrainingConfig:
    epochs: int = 10
    #: Samples per rank per micro-batch; the effective batch is
    #: batch_size x world_size x grad_accum_steps.
    batch_size: int = 32
    grad_accum_steps: int = 1
    #: Stop after this many optimizer steps in all (for smoke runs); null = no limit.
    max_steps: int | None = None
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0
    #: ``linear`` scales lr by effective_batch / base_batch_size (Goyal et al.).
    lr_scaling: Literal["none", "linear"] = "none"
    base_batch_size: int = 32
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: ``auto``: bf16 autocast on GPUs, none on CPU. fp16 adds a gradient scaler.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    grad_clip_norm: float | None = None
    #: Exponential moving average of the weights (e.g. 0.999); validation then uses it.
    ema_decay: float | None = None
    #: Shard optimizer state over ranks (torch's ZeroRedundancyOptimizer).
    zero_optimizer: bool = False
    #: ``ddp``: every rank holds the whole model; ``fsdp2``: parameters, gradients and
    #: optimizer state sharded over the ranks (``fully_shard``; the ``fsdp`` section).
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    seed: int = 0
    #: Deterministic kernels (torch.use_deterministic_algorithms): slower, repeatable.
    deterministic: bool = False
    #: Intra-op threads per rank; null leaves torch's default (or OMP_NUM_THREADS).
    threads_per_rank: int | None = None
    #: ``torch.set_float32_matmul_precision`` on each rank: ``high``/``medium`` let float32
    #: matmuls run on tensor cores (TF32, bf16); null leaves torch's default (``highest``).
    matmul_precision: Literal["highest", "high", "medium"] | None = None

    def __post_init__(self) -> None:
        positive(self.epochs, "training.epochs")
        positive(self.batch_size, "training.batch_size")
        positive(self.grad_accum_steps, "training.grad_accum_steps")
        if self.max_steps is not None:
            positive(self.max_steps, "training.max_steps")
        positive(self.lr, "training.lr")
        non_negative(self.weight_decay, "training.weight_decay")
        non_negative(self.momentum, "training.momentum")
        positive(self.base_batch_size, "training.base_batch_size")
        if self.grad_clip_norm is not None:
            positive(self.grad_clip_norm, "training.grad_clip_norm")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ConfigError(f"training.ema_decay must be in (0, 1), got {self.ema_decay}")
        if self.threads_per_rank is not None:
            positive(self.threads_per_rank, "training.threads_per_rank")


@dataclass(frozen=True)
class DataConfig:
    num_workers: int = 0
    #: ``auto``: pin host memory when training on a GPU.
    pin_memory: bool | Literal["auto"] = "auto"
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    #: Drop each rank's last incomplete training batch.
    drop_last: bool = False
    shuffle: bool = True

    def __post_init__(self) -> None:
        non_negative(self.num_workers, "data.num_workers")
        if self.prefetch_factor is not None:
            positive(self.prefetch_factor, "data.prefetch_factor")
            if self.num_workers == 0:
                raise ConfigError("data.prefetch_factor needs data.num_workers > 0")
        if self.persistent_workers and self.num_workers == 0:
            raise ConfigError("data.persistent_workers needs data.num_workers > 0")


@dataclass(frozen=True)
class EarlyStoppingConfig:
    #: Off when null; else stop after this many validations without improvement.
    patience: int | None = None
    #: The validation metric watched (``loss`` or a metric the job reports).
    metric: str = "loss"
    mode: Literal["min", "max"] = "min"
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.patience is not None:
            positive(self.patience, "validation.early_stopping.patience")
        non_negative(self.min_delta, "validation.early_stopping.min_delta")


@dataclass(frozen=True)
class ValidationConfig:
    every_n_epochs: int = 1
    #: Per-rank evaluation batch; null = training.batch_size.
    batch_size: int | None = None
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)

    def __post_init__(self) -> None:
        positive(self.every_n_epochs, "validation.every_n_epochs")
        if self.batch_size is not None:
            positive(self.batch_size, "validation.batch_size")


@dataclass(frozen=True)
class DistributedConfig:
    device: Literal["auto", "xpu", "cuda", "cpu"] = "auto"
    backend: Literal["auto", "nccl", "xccl", "ccl", "gloo"] = "auto"
    timeout_s: float = 600.0
    #: Connect to rank 0's store and meet every rank within this (DDP_HPC_RENDEZVOUS_TIMEOUT wins).
    rendezvous_timeout_s: float = 180.0
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    #: Compress gradients for the all-reduce (DDP communication hook).
    comm_hook: Literal["none", "fp16", "bf16"] = "none"
    host_suffix: str = ""
    #: End a rank that makes no progress (no step, batch or checkpoint) for this long.
    watchdog_s: float | None = 300.0
    #: Every N optimizer steps, check that all ranks hold bit-identical weights (null: off).
    weights_check_every: int | None = None
    #: Relaunch every rank after a failure, at most this often, when render/submit get no
    #: ``--max-restarts`` for this config.
    max_restarts: int = 0

    def __post_init__(self) -> None:
        positive(self.timeout_s, "distributed.timeout_s")
        positive(self.rendezvous_timeout_s, "distributed.rendezvous_timeout_s")
        if self.watchdog_s is not None:
            positive(self.watchdog_s, "distributed.watchdog_s")
        if self.weights_check_every is not None:
            positive(self.weights_check_every, "distributed.weights_check_every")
        positive(self.bucket_cap_mb, "distributed.bucket_cap_mb")
        non_negative(self.max_restarts, "distributed.max_restarts")


@dataclass(frozen=True)
class FsdpConfig:
    """``training.strategy: fsdp2`` only. The whole model is always one sharded unit; the
    units below it gather their parameters one at a time in forward and backward."""

    #: Module class names sharded as units of their own (e.g. ``[TransformerBlock]``).
    wrap: list[str] = field(default_factory=list)
    #: Also a unit: every submodule holding at least this many parameters outside the
    #: units inside it (null: by ``wrap`` only).
    min_params: int | None = None
    #: Free each unit's gathered parameters after its forward (gather them again in
    #: backward): less memory, one more all-gather per unit and step.
    reshard_after_forward: bool = True
    #: ``bf16``: units compute in bfloat16, gradients are reduced and parameters kept in fp32.
    mixed_precision: Literal["none", "bf16"] = "none"
    #: Recompute each ``wrap``/``min_params`` unit's activations in backward instead of keeping them.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.min_params is not None:
            positive(self.min_params, "fsdp.min_params")
        if self.activation_checkpointing and not self.wrap and self.min_params is None:
            raise ConfigError("fsdp.activation_checkpointing recomputes the units that fsdp.wrap or "
                              "fsdp.min_params name: set one of them")


@dataclass(frozen=True)
class CheckpointConfig:
    #: Save every N optimizer steps (null: not by steps).
    every_n_steps: int | None = None
    #: Save at the end of every N epochs (null: not by epochs).
    every_n_epochs: int | None = 1
    #: Periodic checkpoints kept (``last`` and ``best`` are kept besides).
    keep_last: int = 3
    save_best: bool = True
    #: ``auto``: continue from the newest checkpoint in the run folder; ``never``; or a path.
    resume: str = "auto"
    #: After SIGUSR2/SIGTERM (the job's deadline near, preemption), ranks agree to stop this often.
    preemption_check_every_n_steps: int = 10
    #: A signal that asks the ranks to checkpoint and stop, besides SIGUSR2 and SIGTERM,
    #: and its lead before the job's deadline: ``NAME@SECONDS`` (rendered scripts ask for it).
    stop_signal: str = "USR2@90"
    #: With a known job end (DDP_HPC_DEADLINE), stop when the time left would not cover
    #: the next check interval, a checkpoint and this margin; ``auto``: the measured slowest
    #: step plus checkpoint, at least 10 s (engine/deadline.py); null: never stop for it.
    deadline_margin_s: float | Literal["auto"] | None = "auto"
    #: YAML key ``async``: rank 0 copies the state to host memory and writes the file in a
    #: background thread; training waits only for the copy (ddp_hpc/training/async_checkpoint.py).
    async_write: bool = field(default=False, metadata={"key": "async"})
    #: ``file``: one file that rank 0 writes; ``dcp``: a folder that every rank writes its
    #: part of (torch.distributed.checkpoint); null: ``checkpoint_format`` picks by strategy.
    format: Literal["file", "dcp"] | None = None

    def __post_init__(self) -> None:
        positive(self.preemption_check_every_n_steps, "checkpoint.preemption_check_every_n_steps")
        if self.every_n_steps is not None:
            positive(self.every_n_steps, "checkpoint.every_n_steps")
        if self.every_n_epochs is not None:
            positive(self.every_n_epochs, "checkpoint.every_n_epochs")
        positive(self.keep_last, "checkpoint.keep_last")
        if self.deadline_margin_s not in (None, "auto"):
            non_negative(self.deadline_margin_s, "checkpoint.deadline_margin_s")
        try:
            parse_stop_signal(self.stop_signal)
        except UserError as exc:
            raise ConfigError(f"checkpoint.stop_signal: {exc}") from None


def checkpoint_format(config: Config, checkpoints: Path | None = None) -> str:
    """``checkpoint.format``; when unset, the format of the checkpoint ``checkpoint.resume``
    names, or under ``auto`` the format of the checkpoints in ``checkpoints`` (the run's
    folder) when it holds only the other format's; else the strategy's default: ``dcp`` for
    sharded models (``training.strategy: fsdp2``), ``file`` otherwise."""
    if config.checkpoint.format is not None:
        return config.checkpoint.format
    default = "dcp" if getattr(config.training, "strategy", "ddp") == "fsdp2" else "file"
    resume = config.checkpoint.resume
    if resume not in ("auto", "never"):
        return checkpoint_format_of(Path(resume)) or default
    if resume == "auto" and checkpoints is not None:
        found = formats_in(checkpoints)
        if found and default not in found:
            return found.pop()
    return default


def formats_in(checkpoints: Path) -> set[str]:
    """The formats of the checkpoints in a run's checkpoint folder (empty when none)."""
    try:
        entries = list(checkpoints.iterdir())
    except OSError:
        return set()
    return {fmt for fmt in map(checkpoint_format_of, entries) if fmt is not None}


@dataclass(frozen=True)
class MlflowConfig:
    #: null: a SQLite store in the run folder (``tracking/mlflow.db``); or a server's URI.
    tracking_uri: str | None = None
    #: Experiment name; null = the run name.
    experiment: str | None = None


@dataclass(frozen=True)
class WandbConfig:
    #: null = ``ddp_hpc``.
    project: str | None = None
    entity: str | None = None
    #: ``offline`` writes ``tracking/wandb`` only (``wandb sync`` uploads it); ``online`` needs network.
    mode: Literal["offline", "online"] = "offline"


@dataclass(frozen=True)
class LoggingConfig:
    #: Folder that holds one folder per run.
    run_dir: str = "runs"
    #: Run name; null = the config file's name.
    name: str | None = None
    #: Rank-0 progress bar: ``auto`` shows it on a terminal only.
    progress: Literal["auto", "always", "never"] = "auto"
    #: Also log a line every N optimizer steps (0: epoch lines only).
    log_every_n_steps: int = 0
    #: Experiment trackers rank 0 feeds (docs/tracking.md); each needs its extra installed.
    trackers: list[Literal["tensorboard", "mlflow", "wandb", "csv"]] = field(default_factory=list)
    #: Without a progress bar (e.g. a batch job's log), a progress line this often (0: none).
    progress_every_s: float = 30.0
    #: Draw the training curves (``curves.png``) at the end of the run (needs matplotlib).
    plot: bool = True
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        non_negative(self.log_every_n_steps, "logging.log_every_n_steps")
        non_negative(self.progress_every_s, "logging.progress_every_s")
        if len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"logging.trackers names a tracker twice: {self.trackers}")
        # Whether the trackers' packages are installed is checked where they start (train()),
        # not here: a login node that only submits the config needs none of them.
        if self.name is not None and (not self.name or "/" in self.name or self.name in (".", "..")):
            raise ConfigError(f"logging.name {self.name!r} must be a plain folder name")


@dataclass(frozen=True)
class CallbackConfig:
    #: ``package.module:Class`` of a ``ddp_hpc.training.Callback``.
    target: str = ""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    callbacks: list[CallbackConfig] = field(default_factory=list)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)

    def __post_init__(self) -> None:
        check_strategy(self)

    def run_name(self, config_path: str | Path | None) -> str:
        if self.logging.name:
            return self.logging.name
        return Path(config_path).stem if config_path else "run"

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def with_overrides(self, overrides: list[str]) -> Config:
        """A copy with ``key=value`` overrides applied (and checked like a file's)."""
        return build(Config, apply_overrides(self.to_dict(), list(overrides))) if overrides else self


def check_strategy(config: Config) -> None:
    """Options that the chosen ``training.strategy`` cannot honour, refused in one line."""
    if config.training.strategy == "ddp":
        if config.fsdp != FsdpConfig():
            raise ConfigError("the fsdp section is set but training.strategy is ddp: set training.strategy=fsdp2")
        return
    refused = {
        "training.zero_optimizer": (config.training.zero_optimizer,
                                    "fsdp2 shards the optimizer state already"),
        "training.ema_decay": (config.training.ema_decay is not None,
                               "an average of sharded weights is not supported"),
        "training.precision=fp16": (config.training.precision == "fp16",
                                    "its gradient scaler does not handle sharded gradients; use bf16"),
        "distributed.comm_hook": (config.distributed.comm_hook != "none",
                                  "it is a DDP all-reduce hook; fsdp2 reduce-scatters"),
        "distributed.find_unused_parameters": (config.distributed.find_unused_parameters, "it is a DDP option"),
        "distributed.static_graph": (config.distributed.static_graph, "it is a DDP option"),
        "distributed.weights_check_every": (config.distributed.weights_check_every is not None,
                                            "it compares whole replicas; under fsdp2 each rank holds other shards"),
        "checkpoint.async with checkpoint.format=file": (
            config.checkpoint.async_write and checkpoint_format(config) == "file",
            "its background writer copies one rank's whole model; the dcp format saves shards in the background"),
    }
    for key, (is_set, why) in refused.items():
        if is_set:
            raise ConfigError(f"{key} cannot be used with training.strategy=fsdp2: {why}")


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}): is it the right file?") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"config {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: the top level must be a mapping of sections")
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """The config at ``path`` (or the defaults) with ``key=value`` overrides applied."""
    data = read_yaml(path) if path is not None else {}
    return build(Config, apply_overrides(data, list(overrides or [])))

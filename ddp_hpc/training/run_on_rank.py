"""The rank side of a training run: load and check the config, start the group, fit, report."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ddp_hpc.config import Config, load_config
from ddp_hpc.config_loader import ConfigError
from ddp_hpc.contract import CURVES_FILE, RECOVERY_SHRINK_VAR, RECOVERY_STORE_VAR
from ddp_hpc.startup.distributed import DistributedOptions, GroupStarter, process_group
from ddp_hpc.startup.group_start import GroupStart
from ddp_hpc.errors import UserError
from ddp_hpc.logs import ConsoleFilter, configure_logging, rank_log_path
from ddp_hpc.stop import job_deadline, parse_stop_signal, stop_signals
from ddp_hpc.stop_handler import Listening, rank_stop_handler
from ddp_hpc.summary import RunSummary
from ddp_hpc.tracking.registry import check_installed
from ddp_hpc.training.callbacks import Callback, TrainerView, create_callbacks
from ddp_hpc.training.job import Job, create_job
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.strategy import check_supported, recovery_refusal
from ddp_hpc.training.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainOptions:
    """How ``train`` behaves in its process. The defaults suit a library caller; the CLI,
    which owns its process, asks for signal handling, log set-up and the printed report."""

    device: str | None = None
    backend: str | None = None
    #: Checkpoint and stop on SIGUSR2/SIGTERM (the rank's stop-signal handler, ``stop_handler``,
    #: takes them for the run's duration), and on one it recorded before the run
    #: (``ddp_hpc.record_stop_signals()``, which the CLI calls before torch is imported).
    handle_signals: bool = False
    #: Send ddp_hpc's logs to stderr with the rank in the prefix once the rank is known.
    configure_logs: bool = False
    verbose: bool = False
    #: Print the result and the run folder on rank 0.
    report: bool = False
    #: With ``configure_logs``: the ranks whose INFO lines reach the console (every rank's
    #: lines also go to RUN/logs/rank-NNNNN.log).
    console: ConsoleFilter = ConsoleFilter()


def _listen_for_stops(trainer: Trainer) -> Listening:
    """SIGUSR2 (SLURM's warning before the job's deadline), SIGTERM (preemption, scancel,
    PBS at walltime) and ``checkpoint.stop_signal`` ask the trainer to checkpoint and stop
    at the next agreed step; so does one the rank's handler recorded before training."""
    every = trainer.config.checkpoint.preemption_check_every_n_steps

    def on_stop(signum: int, early: bool) -> None:
        trainer.request_stop()
        log.warning("received %s%s: will checkpoint and stop within %d steps", signal.Signals(signum).name,
                    " during start-up" if early else "", every)

    configured = parse_stop_signal(trainer.config.checkpoint.stop_signal)
    return rank_stop_handler().listen(on_stop, stop_signals(configured))


def distributed_options(config: Config, device: str | None, backend: str | None) -> DistributedOptions:
    """CLI flags win over DDP_HPC_DEVICE/DDP_HPC_BACKEND, which win over the config."""
    dist = config.distributed
    return DistributedOptions(device=device, backend=backend, config_device=dist.device,
                              config_backend=dist.backend, timeout_s=dist.timeout_s,
                              rendezvous_timeout_s=dist.rendezvous_timeout_s,
                              host_suffix=dist.host_suffix or None)


def recovering_start(run: RunFolder) -> GroupStarter:
    """The group started through in-job recovery (``ddp-hpc launch --recover``), which
    records each recovery in ``run``'s record."""

    def start(settings: GroupStart):
        from ddp_hpc.engine.recovery import InJobRecovery

        return InJobRecovery(settings.backend, run_dir=run.path, collective_timeout_s=settings.timeout.total_seconds(),
                             group_start=settings)

    return start


class RankLine(Callback):
    """Each rank's first line in its log file: where it runs (written once set-up passed,
    so a run refused for bad input leaves no file)."""

    def on_fit_start(self, trainer: TrainerView) -> None:
        ctx = trainer.ctx
        log.info("rank %d of %d on host %s (pid %d, local rank %d, device %s), run folder %s", ctx.rank,
                 ctx.world_size, socket.gethostname(), os.getpid(), ctx.local_rank, ctx.torch_device,
                 trainer.run.path)


def train(config: Config | str | Path | None = None, overrides: Sequence[str] = (), *,
          job: Job | None = None, options: TrainOptions = TrainOptions(),
          config_path: str | Path | None = None) -> RunSummary:
    """Run one training job on this rank, under whatever launcher started the process.

    ``config`` is a ``Config``, a YAML path, or None for the defaults; ``overrides`` are
    ``key=value`` strings applied on top; ``job`` replaces the job the config names. Every
    rank returns the run's ``RunSummary`` (``status`` says whether it was preempted, and
    ``exit_status`` what a process that owns the rank exits with). ``config_path``: the file
    a ``Config`` was read from, naming the run as that path would (``ddp-hpc train`` reads
    its config once and hands both on).
    """
    # Everything that can be wrong with the input is checked before any rank starts
    # a process group or writes a file.
    if isinstance(config, Config):
        config_path = str(config_path) if config_path is not None else None
    elif config_path is not None:
        raise TypeError("train: config_path names where a Config was read from; give the path as config instead")
    else:
        config_path = None if config is None else str(config)
    if isinstance(config, Config):
        config = config.with_overrides(list(overrides))
    else:
        config = load_config(config_path, list(overrides))
    check_installed(config.logging.trackers, config.logging.mlflow.tracking_uri)
    check_supported(config)
    recovering = RECOVERY_STORE_VAR in os.environ  # started by `ddp-hpc launch --recover`
    refusal = recovery_refusal(config, shrink=os.environ.get(RECOVERY_SHRINK_VAR) == "1") if recovering else None
    if refusal:
        raise ConfigError(refusal)
    job = job if job is not None else create_job(config.job.name, config.job.params)
    callbacks = create_callbacks(config.callbacks)
    deadline = job_deadline(os.environ)
    run = RunFolder(Path(config.logging.run_dir) / config.run_name(config_path))
    run.check_creatable()
    with process_group(distributed_options(config, options.device, options.backend),
                       start=recovering_start(run) if recovering else None) as ctx:
        if options.configure_logs:
            configure_logging(ctx.rank, verbose=options.verbose, console=options.console,
                              log_file=rank_log_path(run.path, ctx.rank))
            callbacks = [RankLine(), *callbacks]
        listening: Listening | None = None
        trainer: Trainer | None = None
        started = time.time()
        try:
            trainer = Trainer(job, config, ctx, run, callbacks, deadline=deadline)
            if options.handle_signals:
                listening = _listen_for_stops(trainer)
            summary = trainer.fit()
        except UserError:
            raise  # one line from the CLI is enough for bad input
        except Exception as exc:
            # Every rank says where it failed; the first such line in a job log is the cause.
            where = (f"at epoch {trainer.progress.epoch + 1}, step {trainer.progress.global_step}"
                     if trainer is not None else "while setting up training")
            log.error("failed on host %s %s: %s: %s", socket.gethostname(), where, type(exc).__name__,
                      str(exc).splitlines()[0] if str(exc) else "")
            raise
        finally:
            if listening is not None:
                rank_stop_handler().stop_listening(listening)
        if summary.preempted:
            # The signal this rank received; None for the deadline or another rank's signal.
            received = listening.received if listening is not None else []
            summary = replace(summary, stopped_by=signal.Signals(received[0]).name if received else None)
        if options.report and ctx.is_rank_zero and not summary.preempted:
            test = summary.test or {}
            result = "  ".join(f"test {k} {v:.4f}" for k, v in sorted(test.items()))
            print(f"done: {summary.epochs_completed} epochs, {summary.global_step} steps, "
                  f"{summary.wall_time_s:.1f}s  {result}".rstrip(), flush=True)
            print(f"run folder: {run.path}", flush=True)
            curves = run.path / CURVES_FILE
            if config.logging.plot and curves.exists() and curves.stat().st_mtime >= started:
                print(f"training curves: {curves}", flush=True)
        return summary


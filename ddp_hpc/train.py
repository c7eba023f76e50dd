"""``ddp-hpc train``: load and check the config, start the group, fit, report."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_hpc.config import Config, load_config
from ddp_hpc.distributed import DistributedOptions, process_group
from ddp_hpc.errors import UserError
from ddp_hpc.logs import configure_logging
from ddp_hpc.training.callbacks import create_callbacks
from ddp_hpc.training.job import create_job
from ddp_hpc.training.run_folder import RunFolder
from ddp_hpc.training.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainRequest:
    config_path: str | None
    overrides: Sequence[str] = ()
    device: str | None = None
    backend: str | None = None
    verbose: bool = False
    #: Checkpoint and stop on SIGUSR2/SIGTERM (off where another tool owns the signals, e.g. submitit).
    handle_signals: bool = True


class Preempted(UserError):
    """The run stopped on request (time limit, preemption) after writing a checkpoint."""

    exit_code = 75  # EX_TEMPFAIL: try again later


STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def _install_stop_handlers(trainer: Trainer) -> dict:
    """SIGUSR2 (SLURM's warning before the time limit) and SIGTERM (preemption, scancel,
    PBS at walltime) ask the trainer to checkpoint and stop at the next agreed step."""

    def handler(signum: int, frame: object) -> None:
        trainer.request_stop()
        log.warning("received %s: will checkpoint and stop within %d steps", signal.Signals(signum).name,
                    trainer.config.checkpoint.preemption_check_every_n_steps)

    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def distributed_options(config: Config, device: str | None, backend: str | None) -> DistributedOptions:
    """CLI flags win over DDP_HPC_DEVICE/DDP_HPC_BACKEND, which win over the config."""
    dist = config.distributed
    return DistributedOptions(device=device, backend=backend, config_device=dist.device,
                              config_backend=dist.backend, timeout_s=dist.timeout_s,
                              rendezvous_timeout_s=dist.rendezvous_timeout_s,
                              host_suffix=dist.host_suffix or None)


def train(request: TrainRequest) -> dict[str, Any]:
    """Run one training job on this rank; returns the summary (complete on rank 0)."""
    # Everything that can be wrong with the input is checked before any rank starts
    # a process group or writes a file.
    config = load_config(request.config_path, list(request.overrides))
    job = create_job(config.job.name, config.job.params)
    callbacks = create_callbacks(config.callbacks)
    run = RunFolder(Path(config.logging.run_dir) / config.run_name(request.config_path))
    run.check_creatable()
    with process_group(distributed_options(config, request.device, request.backend)) as ctx:
        configure_logging(ctx.rank, verbose=request.verbose)
        trainer = Trainer(job, config, ctx, run, callbacks)
        previous = _install_stop_handlers(trainer) if request.handle_signals else {}
        try:
            summary = trainer.fit()
        except UserError:
            raise  # one line from the CLI is enough for bad input
        except Exception as exc:
            # Every rank says where it failed; the first such line in a job log is the cause.
            log.error("failed on host %s at epoch %d, step %d: %s: %s", socket.gethostname(),
                      trainer.progress.epoch + 1, trainer.progress.global_step, type(exc).__name__,
                      str(exc).splitlines()[0] if str(exc) else "")
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if summary.get("preempted"):
            raise Preempted(f"stopped at step {summary['global_step']} on request; the checkpoint is in "
                            f"{run.checkpoints}: rerun or requeue to resume")
        if ctx.is_rank_zero:
            test = summary.get("test") or {}
            result = "  ".join(f"test {k} {v:.4f}" for k, v in sorted(test.items()))
            print(f"done: {summary['epochs_completed']} epochs, {summary['global_step']} steps, "
                  f"{summary['wall_time_s']:.1f}s  {result}".rstrip(), flush=True)
            print(f"run folder: {run.path}", flush=True)
        return summary

"""When a job must stop to be continued: the stop signal and the job's deadline.

Torch-free, so the launch side (rendered scripts) and the ranks share it:
- ``parse_stop_signal("USR1@120")``: the signal a scheduler sends ahead of the time limit
  and how many seconds ahead (SLURM's ``--signal=[B:]SIG@SECONDS``).
- ``job_deadline(environ)``: the job's end time from the variables a rendered script
  exports, so that the ranks can stop ahead of it with no signal at all (PBS sends none).

The rank's handler of these signals is ``stop_handler.py``'s, the only one.
"""

from __future__ import annotations

import argparse
import math
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from ddp_hpc.contract import DEADLINE_VAR, START_TIME_VAR, WALLTIME_VAR
from ddp_hpc.environment.jobs import end_time_variable
from ddp_hpc.errors import UserError

#: Signals that may ask the ranks to checkpoint and stop. Others are refused: KILL and STOP
#: cannot be caught, and the rest (SEGV, CHLD, PIPE, ...) mean something else.
STOPPABLE = ("USR1", "USR2", "TERM", "INT", "HUP", "ALRM", "XCPU", "PWR")
DEFAULT_LEAD_S = 90
#: SLURM takes sig_time up to 65535 s.
MAX_LEAD_S = 65535


#: Signals that always ask the ranks to checkpoint and stop, whatever ``checkpoint.stop_signal``
#: says: SLURM's warning before the time limit (USR2); preemption, scancel, PBS at walltime (TERM).
ALWAYS_STOP = (signal.SIGUSR2, signal.SIGTERM)


@dataclass(frozen=True)
class StopSignal:
    """A signal that asks the ranks to checkpoint and stop, sent ``lead_s`` before the end."""

    signal: signal.Signals
    lead_s: int = DEFAULT_LEAD_S

    @classmethod
    def default(cls) -> StopSignal:
        return cls(signal.SIGUSR2, DEFAULT_LEAD_S)

    @property
    def name(self) -> str:
        """``USR1``: the spelling SLURM's ``--signal`` and bash's ``trap`` take."""
        return self.signal.name[3:]

    def __str__(self) -> str:
        """``USR1@120``, as in ``#SBATCH --signal=B:USR1@120``."""
        return f"{self.name}@{self.lead_s}"


def parse_stop_signal(text: str) -> StopSignal:
    """``USR1@120``, ``SIGUSR1@120``, ``usr1``, ``10@120`` -> StopSignal; else a one-line UserError.

    Without ``@SECONDS`` the lead is 90 s.
    """
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"stop signal {text!r} is empty: use NAME[@SECONDS], e.g. USR1@120")
    name, at, lead_text = text.strip().partition("@")
    name = name.strip().upper()
    allowed = ", ".join(STOPPABLE)
    if name.isdigit():
        try:
            sig = signal.Signals(int(name))
        except ValueError:
            raise UserError(f"stop signal {text!r}: {name} is not a signal number here (use one of {allowed})") from None
        name = sig.name[3:]
    name = name.removeprefix("SIG")
    if name not in STOPPABLE or not hasattr(signal, f"SIG{name}"):
        raise UserError(f"stop signal {text!r}: {name or '(none)'} cannot ask the ranks to stop; use one of "
                        f"{allowed}, as NAME[@SECONDS] (e.g. USR1@120)")
    lead = DEFAULT_LEAD_S
    if at:
        lead_text = lead_text.strip()
        if not lead_text.isdigit():
            raise UserError(f"stop signal {text!r}: the lead after '@' must be whole seconds, e.g. USR1@120")
        lead = int(lead_text)
        if lead > MAX_LEAD_S:
            raise UserError(f"stop signal {text!r}: the lead {lead} s is over SLURM's limit of {MAX_LEAD_S} s")
    return StopSignal(signal.Signals[f"SIG{name}"], lead)


def stop_signal_arg(text: str) -> StopSignal:
    """``type=`` for an argparse ``--signal`` flag: a bad value is argparse's one-line error."""
    try:
        return parse_stop_signal(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{name}={text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{name}={text!r} is not a number of seconds")
    return value


def stop_signals(stop_signal: StopSignal) -> tuple[signal.Signals, ...]:
    """Every signal that asks the ranks to stop: ``ALWAYS_STOP`` and the configured one."""
    return tuple(dict.fromkeys((*ALWAYS_STOP, stop_signal.signal)))


def job_deadline(environ: Mapping[str, str]) -> float | None:
    """The job's end in seconds since the epoch, or None where nothing says.

    ``DDP_HPC_DEADLINE`` wins; then ``DDP_HPC_START_TIME`` + ``DDP_HPC_WALLTIME_S``; then
    the scheduler's own end time where its job sets one (``SchedulerJob.end_time_variables``). An empty value
    counts as unset (a script's lookup that found nothing); a malformed one is a UserError.
    """
    deadline = _seconds(environ, DEADLINE_VAR)
    if deadline is not None:
        return deadline
    start, walltime = _seconds(environ, START_TIME_VAR), _seconds(environ, WALLTIME_VAR)
    if (start is None) != (walltime is None):
        given, missing = (START_TIME_VAR, WALLTIME_VAR) if start is not None else (WALLTIME_VAR, START_TIME_VAR)
        raise UserError(f"{given} is set but {missing} is not: set both, or {DEADLINE_VAR} alone")
    if start is not None and walltime is not None:
        return start + walltime
    name = end_time_variable(environ)
    return _seconds(environ, name) if name else None


def __getattr__(name: str) -> object:
    if name == "record_stop_signals":  # its old home; the handler is ddp_hpc.stop_handler's
        from ddp_hpc.stop_handler import record_stop_signals

        return record_stop_signals
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

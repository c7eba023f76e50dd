"""Whether a process the launch started is stopped (SIGSTOP, a debugger, a freezer cgroup).

A stopped process sends no heartbeat, but neither does one still starting (a replacement
importing torch): the kernel's process state tells them apart, where a heartbeat cannot.
Linux only (``/proc/PID/stat``); elsewhere nothing is ever seen stopped.
"""

from __future__ import annotations

from pathlib import Path

#: ``/proc/PID/stat`` states of a stopped process: ``T`` stopped by a signal, ``t`` stopped while traced.
STOPPED_STATES = frozenset("Tt")


def parse_state(stat: str) -> str:
    """The state letter of a ``/proc/PID/stat`` line. The command name before it, in
    parentheses, may itself hold spaces and parentheses: the state follows the last ``)``."""
    return stat[stat.rindex(")") + 1:].split()[0]


def process_state(pid: int, proc: Path = Path("/proc")) -> str | None:
    """``pid``'s state letter, or None where it cannot be read (gone, reaped, not Linux)."""
    try:
        return parse_state((proc / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def is_stopped(pid: int, proc: Path = Path("/proc")) -> bool:
    return process_state(pid, proc) in STOPPED_STATES

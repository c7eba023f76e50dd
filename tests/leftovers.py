"""Processes a test leaves behind, ended after it (conftest.py's hooks).

The pytest process makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): a
process whose parent died (a rank whose wrapper was killed, a launch's rank after a
time-out) is reparented to pytest, not to init, so it is still found among pytest's
descendants. After each test, every descendant started during its call and still alive is
killed (SIGKILL), also when the test failed or timed out, and reaped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36

#: (pid, start time in clock ticks): a pid reused later is another process.
Process = tuple[int, int]


def become_subreaper() -> bool:
    """Orphans of this process's descendants come to it; False where the kernel refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time, state) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
        table[int(entry)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def descendants(root: int | None = None) -> dict[Process, str]:
    """Every descendant of ``root`` (this process), with its state (``Z``: a zombie)."""
    root = os.getpid() if root is None else root
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: dict[Process, str] = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        _, started, state = table[pid]
        found[(pid, started)] = state
        stack.extend(children.get(pid, []))
    return found


def end_new(before: dict[Process, str] | set[Process], wait_s: float = 5.0) -> list[int]:
    """Kill every descendant not in ``before``, and reap the ones that came to this process;
    the pids killed."""
    killed = []
    for (pid, started), state in descendants().items():
        if (pid, started) not in before and state != "Z":
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    while True:
        new = [process for process in descendants() if process not in before]
        for pid, _ in new:
            try:
                os.waitpid(pid, os.WNOHANG)  # only this process's own children; the others die with it
            except ChildProcessError:
                pass
        if not new or time.monotonic() > deadline:
            return killed
        time.sleep(0.05)

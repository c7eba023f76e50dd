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


def command_line(pid: int) -> str:
    """What ``pid`` runs, shortened, for the warning that names it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(word.decode(errors="replace") for word in words if word)
    if not text:  # exiting: its memory, and with it its command line, is gone
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read()
            text = f"{fields[fields.index('(') + 1:fields.rindex(')')]}, state {fields[fields.rindex(')') + 2]}"
        except (OSError, ValueError):
            return "?"
    return text if len(text) <= 120 else text[:117] + "..."


def end_new(before: dict[Process, str] | set[Process], wait_s: float = 5.0, settle_s: float = 2.0) -> list[str]:
    """Kill every descendant not in ``before``, and reap the ones that came to this process;
    the processes killed, each as ``pid (command line)``. Each first has ``settle_s`` to end
    by itself: a rank that a launcher killed may still be in the kernel's exit path (its memory
    gone, not yet a zombie) when the launcher returns, and multiprocessing's resource tracker
    ends only after the ranks that wrote to it."""
    deadline = time.monotonic() + settle_s
    while any(process not in before and state != "Z" for process, state in descendants().items()) \
            and time.monotonic() < deadline:
        _reap(before)
        time.sleep(0.05)
    killed = []
    for (pid, started), state in descendants().items():
        if (pid, started) not in before and state != "Z":
            what = command_line(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{pid} ({what})")
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    while _reap(before) and time.monotonic() <= deadline:
        time.sleep(0.05)
    return killed


def _reap(before: dict[Process, str] | set[Process]) -> bool:
    """Reap the new descendants that came to this process; whether any new one is left."""
    new = [process for process in descendants() if process not in before]
    for pid, _ in new:
        try:
            os.waitpid(pid, os.WNOHANG)  # only this process's own children; the others die with it
        except ChildProcessError:
            pass
    return bool(new)

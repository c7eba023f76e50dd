"""A cgroup v1 cpu group with the largest cpu.shares, for launches whose ranks must not be
slowed unevenly by whatever else runs on the machine (the other xdist worker): a rank given
half the CPU of the other for a whole heartbeat window is a straggler."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import need

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def remove_cgroups(*groups: Path) -> None:
    """Child groups first; a process still inside (a rank that outlived a failure) is moved to
    the root group first, so nothing is left with the job's cpu.shares or a rank's quota."""
    for group in groups:
        if not group.exists():
            continue
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
            except OSError:  # gone meanwhile
                pass
        group.rmdir()


def need_cpu_cgroups() -> None:
    need((CPU_CGROUP / "cpu.cfs_quota_us").exists() and os.access(CPU_CGROUP, os.W_OK),
         "needs the cgroup v1 cpu controller, writable (root)")


@contextmanager
def alone_at_the_top() -> Iterator[None]:
    """Held while a launch runs in a group with the largest cpu.shares: two such groups at
    once (the straggler test beside the restarts reference, one per xdist worker) share the
    CPU evenly, and the straggler test's uncapped rank, slowed as much as its capped one,
    is no longer twice as fast (seen once in a clean-clone run: no straggler named)."""
    with open(Path(tempfile.gettempdir()) / "ddp-hpc-test-cpu-shares.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextmanager
def favoured(name: str) -> Iterator[tuple[Path, list[str]]]:
    """A group with the largest cpu.shares, and the argv prefix that starts a command inside
    it (the shell joins the group, then becomes the command: its children start inside)."""
    need_cpu_cgroups()
    with alone_at_the_top():
        group = CPU_CGROUP / f"ddp-hpc-test-{name}-{os.getpid()}"
        group.mkdir()
        try:
            (group / "cpu.shares").write_text("262144")
            yield group, ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group)]
        finally:
            remove_cgroups(group)

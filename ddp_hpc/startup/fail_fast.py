"""When one rank fails, end the whole job through its launcher, and say which rank it was.

torchrun, Open MPI's ``mpiexec`` and ``srun --kill-on-bad-exit=1`` end every rank when one
exits non-zero. MPICH's Hydra does not: it ends the job at once only when a rank dies by
a signal or calls PMI's ``abort``, and waits for the others after a plain ``exit(2)``
(measured: 30 s of a sleeping peer, i.e. until the collective timeout in a real job).
Plain ``srun`` waits too. So a failing rank asks the launcher, in its own terms:

- Hydra (``PMI_FD`` set): the PMI-1 wire command ``cmd=abort exitcode=N``, as
  ``MPI_Abort`` sends it; ``mpiexec`` then kills every rank and exits with ``N``;
- ``srun`` tasks: ``scancel --ctld --signal=KILL JOB.STEP`` for this job step only.

Each launcher's environment class says how (``ClusterEnvironment.abort_request`` in
``environment/launchers.py``). The CLI calls :func:`end_job` after it has printed its
error line and before it exits.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Mapping, Sequence

from ddp_hpc.contract import AGREED_EXIT_STATUSES
from ddp_hpc.environment import detect_launcher

log = logging.getLogger(__name__)

#: Time for the launcher to pass on this rank's last output before the others are killed
#: (Hydra drops what its proxy has not yet read once the job is aborted), counted from when
#: it has read that output out of the rank's pipe; the most this rank waits for that read.
OUTPUT_GRACE_S = 0.5
OUTPUT_READ_WITHIN_S = 5.0


def unread_bytes(fd: int) -> int:
    """The bytes written to the pipe at ``fd`` that its reader (the launcher's proxy) has not
    read yet; 0 where ``fd`` is no pipe (a terminal, a file) or cannot be asked."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        count = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, count)  # Linux and macOS answer it on either end of a pipe
        return count[0]
    except OSError:
        return 0


def wait_until_output_read(within_s: float = OUTPUT_READ_WITHIN_S, fds: Sequence[int] = (1, 2)) -> None:
    """Return once the launcher has read what this rank wrote to ``fds``, or after ``within_s``.
    A loaded node's proxy may read it well after the fixed grace alone would have passed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    deadline = time.monotonic() + within_s
    for fd in fds:
        while unread_bytes(fd) and time.monotonic() < deadline:
            time.sleep(0.02)


def _rank_and_size(environ: Mapping[str, str]) -> tuple[int, int] | None:
    try:
        launcher = detect_launcher(environ)
        info = launcher.ranks(environ)
    except Exception:  # malformed variables: that error is reported on its own
        return None
    return info.rank, info.world_size


def rank_label(environ: Mapping[str, str] | None = None) -> str:
    """``"rank 1 on host n2: "`` for a rank of a multi-rank launch, else ``""``."""
    environ = os.environ if environ is None else environ
    found = _rank_and_size(environ)
    if found is None or found[1] <= 1:
        return ""
    return f"rank {found[0]} on host {socket.gethostname()}: "


def with_rank(message: str, environ: Mapping[str, str] | None = None) -> str:
    """``message`` led by the rank and host it comes from, unless it names them already."""
    label = rank_label(environ)
    return message if not label or message.startswith(label) else label + message


def abort_request(environ: Mapping[str, str]) -> tuple[str, str | list[str]] | None:
    """How to make this rank's launcher end the job: ``("pmi", fd)``, ``("command", argv)``,
    or None where the launcher ends it on its own (or there is no one else to end)."""
    found = _rank_and_size(environ)
    if found is None or found[1] <= 1:
        return None
    return detect_launcher(environ).abort_request(environ)


def end_job(exit_code: int, environ: Mapping[str, str] | None = None,
            run: Callable[[Sequence[str]], object] | None = None) -> str | None:
    """Ask the launcher to end every rank after this one failed with ``exit_code``.

    Returns what was done (for tests and logs), or None. Never raises: the rank is
    ending anyway, and its own exit still reaches the launcher.
    """
    environ = os.environ if environ is None else environ
    if exit_code in AGREED_EXIT_STATUSES:  # every rank ends so: nothing to end
        return None
    request = abort_request(environ)
    if request is None:
        return None
    kind, target = request
    wait_until_output_read()
    time.sleep(OUTPUT_GRACE_S)
    try:
        if kind == "pmi":
            os.write(int(target), f"cmd=abort exitcode={exit_code}\n".encode())
            return f"PMI abort with exit code {exit_code}"
        argv = list(target)
        if shutil.which(argv[0]) is None:
            return None
        (run or _run_quietly)(argv)
        return " ".join(argv)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("could not ask the launcher to end the job: %s", exc)
        return None


def _run_quietly(argv: Sequence[str]) -> None:
    subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=30, check=False)

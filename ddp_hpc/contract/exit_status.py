"""What a rank, a launch or a rendered script exits with, and which statuses every rank
reaches together."""

from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    """What a rank, a launch or a rendered script exits with."""

    OK = 0
    #: A failure (a bug, a failed job): the traceback or the log says why.
    FAILED = 1
    #: The user's mistake (bad input, a missing tool): one line, no traceback. Never
    #: restarted (a restart meets the same mistake) nor spent as an in-job recovery.
    USAGE = 2
    #: The watchdog ended a rank that made no progress for too long (``engine/watchdog.py``:
    #: stuck in its own code, or in a collective waiting for a rank that is gone or frozen),
    #: after logging where it was and every thread's stack. A failure: restarted as one.
    WATCHDOG = 3
    #: Checkpointed and stopped on request (time limit, preemption): continue me
    #: (EX_TEMPFAIL, "try again later"). Not a failure: nothing restarts it as one.
    REQUEUE = 75
    #: ``ddp-hpc run``: the command was found but cannot be executed; not found (the shell's codes).
    CANNOT_EXECUTE = 126
    NOT_FOUND = 127
    #: Interrupted by Ctrl-C (128 + SIGINT).
    INTERRUPTED = 130
    #: 128 + SIGTERM: what ``srun --kill-on-bad-exit`` reports when the first rank to exit
    #: with REQUEUE got the others killed. The ``preempted`` marker tells the two apart.
    SIGTERM = 143

    @classmethod
    def of_returncode(cls, returncode: int) -> int:
        """A shell's exit status for ``subprocess``'s return code (``-15`` -> 143)."""
        return returncode if returncode >= 0 else 128 - returncode


#: Statuses that every rank reaches together: they end no one else's job.
AGREED_EXIT_STATUSES = frozenset({ExitStatus.OK, ExitStatus.REQUEUE})

"""Errors that are the user's to fix.

A ``UserError`` carries one line that names what is wrong and how to fix it. The CLI
prints it without a traceback and exits with status 2; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import logging

from ddp_hpc.contract import ExitStatus

log = logging.getLogger(__name__)


class UserError(Exception):
    """Bad input, an impossible choice or a missing tool: one line, exit code 2."""

    exit_code = ExitStatus.USAGE


class EnvironmentConflictError(UserError):
    """Two launchers' variables disagree about this process's rank or world size."""


class DeviceUnavailableError(UserError):
    """The requested device or communication backend cannot work on this host."""


class TooFewDevicesError(DeviceUnavailableError):
    """More ranks on this node than devices of the chosen type, none given its own."""


class RefusedOnRank(UserError, SystemExit):
    """A ``UserError`` that a rank of a user's own script meets (``InJobRecovery``): the same
    mistake on every rank. Uncaught, it ends the process with status 2 and no traceback, as
    the CLI does, so that the launch takes it for the user's mistake and spends no in-job
    recovery on it (a traceback's status 1 reads as a lost rank). Its one line is logged
    when it is raised (Python prints nothing for an uncaught exit status); ``reported`` tells
    the CLI not to print it again."""

    reported = True

    def __init__(self, message: str, rank: int) -> None:
        UserError.__init__(self, message)
        self.code = ExitStatus.USAGE
        log.error("rank %d: %s", rank, message)

    def __str__(self) -> str:
        return str(self.args[0])

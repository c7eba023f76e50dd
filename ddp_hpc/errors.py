"""Errors that are the user's to fix.

A ``UserError`` carries one line that names what is wrong and how to fix it. The CLI
prints it without a traceback and exits with status 2; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

from ddp_hpc.contract import ExitStatus


class UserError(Exception):
    """Bad input, an impossible choice or a missing tool: one line, exit code 2."""

    exit_code = ExitStatus.USAGE


class EnvironmentConflictError(UserError):
    """Two launchers' variables disagree about this process's rank or world size."""


class DeviceUnavailableError(UserError):
    """The requested device or communication backend cannot work on this host."""

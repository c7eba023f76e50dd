"""The errors of in-job recovery that end a rank's wait or its group."""

from __future__ import annotations

from ddp_hpc.contract import DEBUG_VAR, ExitStatus


class RecoveryError(RuntimeError):
    """The job cannot recover in place (no new group in time, the launch gave up, both
    copies of a shard lost): the rank exits with a failure and the launch restarts in place
    from the newest checkpoint.

    Not a crash but the fall-back working: uncaught, ``ddp-hpc run``'s script runner and the
    CLI report it in one line and exit ``one_line_status``, without a traceback unless the
    variable ``one_line_unless`` is set (``ddp-hpc --debug`` sets it). The runner reads both
    from the class: it imports nothing of ddp_hpc."""

    one_line_status = int(ExitStatus.FAILED)
    one_line_unless = DEBUG_VAR


class Superseded(RuntimeError):
    """The group being formed lost a member before it formed: the next plan follows."""


class GroupAborted(RuntimeError):
    """The rank's process group was aborted while a step ran (a peer was lost under NCCL):
    the step is not applied and the survivors form the next group."""

"""The errors of in-job recovery that end a rank's wait or its group."""

from __future__ import annotations


class RecoveryError(RuntimeError):
    """The job cannot recover in place (no new group in time, the launch gave up): the rank
    exits with a failure and the launch restarts in place from the newest checkpoint."""


class Superseded(RuntimeError):
    """The group being formed lost a member before it formed: the next plan follows."""


class GroupAborted(RuntimeError):
    """The rank's process group was aborted while a step ran (a peer was lost under NCCL):
    the step is not applied and the survivors form the next group."""

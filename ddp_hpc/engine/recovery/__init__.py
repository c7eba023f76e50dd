"""In-job recovery: a lost rank replaced inside the running job, its state from the survivors.

One entry, ``InJobRecovery`` (``rank.py``), which a loop or the Trainer runs on every rank;
the rest are its parts:

- ``store``: the keys the ranks and the launch (``launch/recovering.py``) meet under, in a
  store the launch serves, and the ``Plan`` of each new group;
- ``store_server``: that store served, and read, without torch (torch's TCPStore protocol);
- ``record``: each recovery in the run record (torch-free);
- ``backends``: which process-group backends a broken group can be left on (torch-free:
  the launch asks before any rank starts);
- ``rank``: ``InJobRecovery``, the rank side: the user's loop through losses, each step's
  end (the derived streams), a recovery's order; its parts, one role each:
  ``membership`` (the launch's plans, forming each group), ``group_abort`` (leaving a broken
  group: its sockets shut down over gloo, aborted over NCCL), ``transfer`` (who sends the
  state, and loading it), ``snapshot_keeping`` (a sharded model's snapshots and roll-back),
  ``refusals`` (what ``run`` refuses before the first step), ``broken_step`` (what a broken
  step left, cleared);
- ``fence``: over NCCL, a step counts only where its collectives finished before an abort;
- ``shards``: a sharded model's snapshots in node-local memory, swapped with buddy ranks;
- ``payload``: a state as one uint8 tensor (``weights_only`` on the way back); ``errors``.

The package imports nothing until a name is asked for, so the torch-free parts stay
torch-free for the launch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NAMES = {
    "InJobRecovery": "rank",
    "RecoveryError": "errors",
    "Superseded": "errors",
    "GroupAborted": "errors",
    "STREAM_SEED": "transfer",
    "is_collective_error": "group_abort",
    "is_sharded": "refusals",
    "run_refusal": "refusals",
    "spare_places": "membership",
    "broadcast_state": "transfer",
    "state_from_tensor": "payload",
    "state_to_tensor": "payload",
    "RecoveryEvent": "record",
    "read_recoveries": "record",
    "write_recovery": "record",
    "backend_refusal": "backends",
}

__all__ = sorted(_NAMES)

if TYPE_CHECKING:
    from ddp_hpc.engine.recovery.backends import backend_refusal
    from ddp_hpc.engine.recovery.errors import GroupAborted, RecoveryError, Superseded
    from ddp_hpc.engine.recovery.payload import state_from_tensor, state_to_tensor
    from ddp_hpc.engine.recovery.group_abort import is_collective_error
    from ddp_hpc.engine.recovery.membership import spare_places
    from ddp_hpc.engine.recovery.rank import InJobRecovery
    from ddp_hpc.engine.recovery.refusals import is_sharded, run_refusal
    from ddp_hpc.engine.recovery.transfer import STREAM_SEED, broadcast_state
    from ddp_hpc.engine.recovery.record import RecoveryEvent, read_recoveries, write_recovery


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

"""Where in-job recovery meets: a store the launch serves, so that it outlives every rank.

``ddp-hpc launch --recover`` serves a ``TCPStore`` in its own process (torchrun's agent
store does the same) and tells the ranks its address (``RECOVERY_STORE_VAR``). Rank 0
cannot serve it: its loss would take the store down with it. Keys, all under ``PREFIX``:

- ``plan/<generation>``: the launch's ``Plan`` for each group after the first (who is in
  it, which rank was lost and why); ``latest`` holds the newest generation.
- ``gen<generation>/``: the prefix each group's own rendezvous keys live under, so that a
  new group never reads a broken one's keys.
- ``alive/<slot>``: a counter each rank's heartbeat thread bumps; the launch ends a rank
  whose counter stands still (a frozen process: SIGSTOP, a hang holding the interpreter).
- ``ready/<slot>``: the rank takes part in in-job recovery (``InJobRecovery`` started);
  a launch recovers only when every live rank did.
- ``rng/<slot>/<step % 2>``: the rank's RNG streams after its last two steps, for its
  replacement.
- ``recovered/<generation>``: that group completed its first step (set by its rank 0).
- ``spare/<id>``: the slot a warm spare takes (``--warm-spare``), set by the launch when
  it chooses the spare to replace a lost rank.

A *slot* is a rank's place in the launch (its first ``RANK``); its rank in a group after a
shrink may differ.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PREFIX = "ddp_hpc/recovery/"
LATEST_KEY = PREFIX + "latest"


def plan_key(generation: int) -> str:
    return f"{PREFIX}plan/{generation}"


def group_prefix(generation: int) -> str:
    return f"{PREFIX}gen{generation}/"


def alive_key(slot: int) -> str:
    return f"{PREFIX}alive/{slot}"


def ready_key(slot: int) -> str:
    return f"{PREFIX}ready/{slot}"


def recovered_key(generation: int) -> str:
    return f"{PREFIX}recovered/{generation}"


def spare_key(spare: str) -> str:
    return f"{PREFIX}spare/{spare}"


def rng_key(slot: int, step: int) -> str:
    return f"{PREFIX}rng/{slot}/{step % 2}"


@dataclass(frozen=True)
class Plan:
    """The group of one generation, as the launch decided it after a rank was lost."""

    generation: int
    world_size: int
    #: slot -> rank in this group.
    ranks: dict[int, int]
    lost: int
    host: str
    cause: str
    #: ``time.time()`` when the launch saw the loss (the rank's exit, or its frozen heartbeat).
    detected_at: float
    replaced: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        raw = json.loads(text)
        return cls(**{**raw, "ranks": {int(slot): int(rank) for slot, rank in raw["ranks"].items()}})


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the launch's store at ``host:port``."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def rng_to_bytes(step: int, state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": step, "rng": state}, buffer)
    return buffer.getvalue()


def rng_from_bytes(data: bytes) -> tuple[int, dict[str, Any]]:
    saved = torch.load(io.BytesIO(data), weights_only=True)
    return int(saved["step"]), saved["rng"]


class LaunchStore:
    """The launch's side: serves the store on a free port of this host and reads and
    writes the keys above."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"

    def publish(self, plan: Plan) -> None:
        self.store.set(plan_key(plan.generation), plan.to_json())
        self.store.set(LATEST_KEY, str(plan.generation))

    def beats(self, slot: int) -> int:
        return int(self.store.add(alive_key(slot), 0))

    def ready(self, slot: int) -> bool:
        return bool(self.store.check([ready_key(slot)]))

    def assign(self, spare: str, slot: int) -> None:
        """The warm spare ``spare`` takes the place of the rank in ``slot`` (after ``publish``)."""
        self.store.set(spare_key(spare), str(slot))

    def recovered(self, generation: int) -> bool:
        return bool(self.store.check([recovered_key(generation)]))

    def forget(self, slot: int) -> None:
        """The rank in ``slot`` is gone: its replacement is ready once it says so itself."""
        self.store.delete_key(ready_key(slot))

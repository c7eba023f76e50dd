"""Where a sharded model's snapshots are kept, torch-free: who holds whose copies (``Buddies``),
how many steps of each are kept, which steps a node's folder holds, and what they take of
the node's memory. The launch reads it (``launch/recovering.py``) without importing torch;
``shards.py`` writes and reads the copies themselves."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Copies of each snapshot kept is the rank's own plus ``replicas - 1`` on its buddies.
DEFAULT_REPLICAS = 2
#: Steps of each copy kept (see shards.py's docstring for why three).
KEPT_STEPS = 3
STEP_FILE = re.compile(r"step(\d+)\.pt$")


@dataclass(frozen=True)
class Buddies:
    """Who holds whose copies: the copies of ``slot`` are held by the ``replicas - 1`` slots
    ``distance``, ``2 x distance``, ... after it (modulo the world)."""

    world_size: int
    distance: int
    replicas: int = DEFAULT_REPLICAS

    def holders(self, slot: int) -> list[int]:
        return [(slot + j * self.distance) % self.world_size for j in range(1, self.replicas)]

    def held_by(self, slot: int) -> list[int]:
        """The slots whose copies ``slot`` holds."""
        return [(slot - j * self.distance) % self.world_size for j in range(1, self.replicas)]

    def refusal(self, hosts: Sequence[str] | None = None) -> str | None:
        """Why these buddies cannot keep every shard through the loss of a rank (or of a
        host, where ``hosts`` names each slot's), one line; or None."""
        if self.replicas < 2:
            return f"snapshot replicas must be at least 2 (the rank's own copy and a buddy's), not {self.replicas}"
        if self.distance < 1:
            return f"the buddy distance must be at least 1 rank, not {self.distance}"
        for slot in range(self.world_size):
            holders = self.holders(slot)
            if slot in holders or len(set(holders)) < len(holders):
                return (f"{self.replicas} copies of each snapshot, {self.distance} ranks apart, do not fit in "
                        f"{self.world_size} ranks: slot {slot}'s copies would be held by "
                        f"{sorted(set(holders) | {slot})}")
            if hosts is not None and len(set(hosts)) > 1:
                same = [holder for holder in holders if hosts[holder] == hosts[slot]]
                if same:
                    return (f"the buddy of rank {slot} (rank {same[0]}) is on its host {hosts[slot]}: a lost host "
                            f"would lose both copies; make the buddy distance ({self.distance}) the number of "
                            f"ranks per host (LOCAL_WORLD_SIZE), with the ranks of a host numbered together")
        return None

    def slots_on_host(self, hosts: Sequence[str], host: str) -> set[int]:
        """The slots whose copies the node ``host`` keeps files of: its ranks' own and the
        ones they hold. A rank and its buddy on one host write one file per slot and step."""
        mine = [slot for slot in range(self.world_size) if hosts[slot] == host]
        return set(mine) | {held for slot in mine for held in self.held_by(slot)}

    def gone_together(self, lost: Iterable[int]) -> list[tuple[int, list[int]]]:
        """Each slot in ``lost`` whose buddies (every holder of its copies) are in ``lost``
        too, with them: where the nodes' memory went with the ranks, no copy is left."""
        lost = set(lost)
        return [(slot, self.holders(slot)) for slot in sorted(lost) if set(self.holders(slot)) <= lost]


def steps_held(directory: Path, slot: int) -> list[int]:
    """The steps of ``slot``'s copies in a node's folder (``<root>/<host>``)."""
    folder = directory / f"slot{slot}"
    found = (STEP_FILE.search(path.name) for path in folder.glob("step*.pt")) if folder.is_dir() else ()
    return sorted(int(match.group(1)) for match in found if match)


def node_bytes(hosts: Sequence[str], payloads: Sequence[int], buddies: Buddies,
               steps: int = KEPT_STEPS) -> dict[str, int]:
    """What each host's memory holds of the snapshots once ``KEPT_STEPS`` were taken: one
    file per slot and step it keeps (``slots_on_host``) of that slot's size (``payloads``,
    by slot), plus each of its ranks' host buffers (one copy of its own state, in the
    rank's process). ``steps=KEPT_STEPS + 1``: at its most, while each slot's newest file is
    written and the oldest not removed yet."""
    held = {}
    for host in dict.fromkeys(hosts):
        slots = buddies.slots_on_host(hosts, host)
        files = steps * sum(payloads[slot] for slot in slots)
        buffers = sum(payloads[slot] for slot in range(len(hosts)) if hosts[slot] == host)
        held[host] = files + buffers
    return held


def describe_lost_together(gone: Sequence[tuple[int, list[int]]]) -> str:
    """``rank 1 and its buddy rank 2 lost together: both copies of their shards are gone``."""
    slot, holders = gone[0]
    if len(holders) == 1:
        return f"rank {slot} and its buddy rank {holders[0]} lost together: both copies of their shards are gone"
    return (f"rank {slot} and its buddies (ranks {', '.join(map(str, holders))}) lost together: every copy of its "
            f"shards is gone")

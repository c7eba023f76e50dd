"""Where in-job recovery meets: a store the launch serves, so that it outlives every rank.

``ddp-hpc launch --recover`` serves a ``TCPStore`` in its own process (torchrun's agent
store does the same) and tells the ranks its address (``RECOVERY_STORE_VAR``). Rank 0
cannot serve it: its loss would take the store down with it. Keys, all under ``PREFIX``:

- ``plan/<generation>``: the launch's ``Plan`` for each group after the first (who is in
  it, which rank was lost and why); ``latest`` holds the newest generation.
- ``gen<generation>/``: the prefix each group's own rendezvous keys live under, so that a
  new group never reads a broken one's keys.
- ``heartbeat/<slot>``, ``host/<slot>``, ``status/<slot>``: the rank's one heartbeat
  (``engine/liveness.py``, ``BEAT_KEYS``: the rendezvous store's layout under this prefix),
  a counter its thread bumps; the launch ends a rank whose counter stands still (a frozen
  process: SIGSTOP, a hang holding the interpreter), and a watchdog in the rank names the
  silent ranks from the same counters.
- ``ready/<slot>``: the rank takes part in in-job recovery (``InJobRecovery`` started);
  a launch recovers only when every live rank did.
- ``seed/<slot>``: the base seed of the rank's streams (set once; its replacement takes
  it: the streams after any step are ``step_seed(base, step)``).
- ``joined/<generation>``: members of that group that came to form it (a counter), and
  ``formed/<generation>``: all of them came (set by the last), or a newer plan let the
  group go (set by the launch), so that none connects to a member that died starting.
- ``recovered/<generation>``: that group completed its first step (set by its rank 0).
- ``spare/<id>``: the slot a warm spare takes (``--warm-spare``), set by the launch when
  it chooses the spare to replace a lost rank.
- ``generations``: a counter each plan's generation is drawn from (``store.add``), so that
  node supervisors (``ddp-hpc launch --node-supervisor``) that lose ranks at the same time
  never publish two plans of one generation.
- ``stop``: the stop signal the outer launch asks every node supervisor to pass on to its
  ranks (a launcher such as MPICH's Hydra does not pass SIGUSR2 on to its tasks).
- ``snapshots``: a sharded model's snapshot layout (buddies, folder), set by rank 0 before
  the first step, so that the launch sees when a rank and its buddies are lost together.
- ``give_up``: why the ranks cannot recover in the job (both copies of a shard gone), set
  by rank 0 of a group whose roll-back found none: the launch gives up at the survivors'
  exits instead of recovering them.

A *slot* is a rank's place in the launch (its first ``RANK``); its rank in a group after a
shrink may differ.

What each side costs as the ranks grow (``ddp-hpc bench scale``, docs/performance.md): a
rank's beat is two round trips whatever happened; a plan is a few dozen bytes whatever the
number of ranks (its slots are said as the slots left out), so N survivors reading it cost
the store O(N) bytes, not O(N^2); the launch asks whether its ranks are ready, and reads
their counters, in requests of ``KEYS_PER_REQUEST`` keys, not one request a rank.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ddp_hpc.engine.liveness import BeatKeys, read_beats
from ddp_hpc.startup.batches import store_batches

if TYPE_CHECKING:
    import torch.distributed as dist

    from ddp_hpc.engine.liveness import Heartbeat

PREFIX = "ddp_hpc/recovery/"
LATEST_KEY = PREFIX + "latest"
GENERATIONS_KEY = PREFIX + "generations"
STOP_KEY = PREFIX + "stop"
SNAPSHOTS_KEY = PREFIX + "snapshots"
GIVE_UP_KEY = PREFIX + "give_up"
#: How long a node supervisor waits for the launch's store to answer.
CONNECT_TIMEOUT_S = 60.0
#: Each rank's heartbeat: the same layout as in the rendezvous store, by slot.
BEAT_KEYS = BeatKeys(PREFIX)
#: How long a watchdog's diagnosis watches the counters: ten of the recovery's quick beats,
#: so that a rank slowed by load is not named silent.
SETTLE_S = 2.5


def plan_key(generation: int) -> str:
    return f"{PREFIX}plan/{generation}"


def group_prefix(generation: int) -> str:
    return f"{PREFIX}gen{generation}/"


def alive_key(slot: int) -> str:
    """The heartbeat counter of the rank in ``slot``."""
    return BEAT_KEYS.beat(slot)


def ready_key(slot: int) -> str:
    return f"{PREFIX}ready/{slot}"


def recovered_key(generation: int) -> str:
    return f"{PREFIX}recovered/{generation}"


def spare_key(spare: str) -> str:
    return f"{PREFIX}spare/{spare}"


def joined_key(generation: int) -> str:
    return f"{PREFIX}joined/{generation}"


def formed_key(generation: int) -> str:
    return f"{PREFIX}formed/{generation}"


def seed_key(slot: int) -> str:
    return f"{PREFIX}seed/{slot}"


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
    #: The launch gives in-job recovery up (no recovery left, a rank's own mistake): every
    #: survivor ends at once, and the launch restarts in place or ends.
    gave_up: bool = False
    #: The lost process was itself a replacement (or the warm spare) the launch put in the slot.
    replacement: bool = False

    def to_json(self) -> str:
        """Every survivor reads it: where the ranks are the slots in order, numbered from 0
        (always, as the launch builds them), only the slots left out are written."""
        raw = asdict(self)
        slots = sorted(self.ranks)
        if all(self.ranks[slot] == rank for rank, slot in enumerate(slots)):
            upto = slots[-1] + 1 if slots else 0
            members = set(slots)
            raw["ranks"] = {"upto": upto, "out": [slot for slot in range(upto) if slot not in members]}
        return json.dumps(raw)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        raw = json.loads(text)
        written = raw["ranks"]
        if "upto" in written:  # slots are digits: never a key of the full form
            out = set(written["out"])
            ranks = {slot: rank for rank, slot in enumerate(s for s in range(written["upto"]) if s not in out)}
        else:
            ranks = {int(slot): int(rank) for slot, rank in written.items()}
        return cls(**{**raw, "ranks": ranks})


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A rank's client of the launch's store at ``host:port``: torch's own (a group forms
    over ``PrefixStore``s of it)."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def latest(store: dist.Store) -> int:
    """The newest plan's generation (0: none yet): one round trip (``add`` of 0 reads
    ``latest``, creating it as 0 where no plan was published yet)."""
    return int(store.add(LATEST_KEY, 0))


def beat(store: dist.Store, slot: int) -> int:
    """What a rank's heartbeat (``heartbeat``) sends each beat, for a simulated rank
    (``ddp-hpc bench``): its counter bumped; the newest plan's generation. Two round trips,
    before and after a loss."""
    store.add(alive_key(slot), 1)
    return latest(store)


def heartbeat(address: str, slot: int, members: Callable[[], Sequence[int]], on_beat: Callable[[dist.Store], None],
              interval_s: float, store_timeout_s: float) -> Heartbeat:
    """The heartbeat of the rank in ``slot`` in the launch's store at ``host:port``: the
    launch's hang detector reads its counter, and so does a watchdog given it, which reports
    through it. ``members``: the slots of the current group, in rank order."""
    from ddp_hpc.engine.liveness import Heartbeat

    host, _, port = address.rpartition(":")
    return Heartbeat(slot, len(members()), socket.gethostname(), host, int(port), interval_s=interval_s,
                     store_timeout_s=store_timeout_s, keys=BEAT_KEYS, members=members, on_beat=on_beat,
                     settle_s=max(2.5 * interval_s, SETTLE_S), store_name="launch's store")


def read_plan(store: dist.Store, generation: int) -> Plan | None:
    """The plan of ``generation`` where it was published, without waiting."""
    key = plan_key(generation)
    return Plan.from_json(store.get(key)) if store.check([key]) else None


def give_up(store: dist.Store, cause: str) -> None:
    """The ranks cannot recover in the job (``cause``, one line): the launch gives up at the
    next exit it sees (``LaunchStore.given_up``)."""
    store.set(GIVE_UP_KEY, cause)


def publish_snapshots(store: dist.Store, world_size: int, distance: int, replicas: int, folder: str) -> None:
    """A sharded model's snapshot layout, for the launch (``LaunchStore.snapshot_layout``)."""
    store.set(SNAPSHOTS_KEY, json.dumps({"world_size": world_size, "distance": distance, "replicas": replicas,
                                         "folder": folder}))


def wait_plan(store: dist.Store, generation: int, timeout_s: float) -> Plan:
    """The plan of ``generation``, waiting up to ``timeout_s`` for the launch to publish it
    (the store tells the waiting client when the key is set: nothing polls). Raises the
    store's error (``DistStoreError``) when it does not come."""
    store.wait([plan_key(generation)], timedelta(seconds=timeout_s))
    return Plan.from_json(store.get(plan_key(generation)))


class LaunchStore:
    """The launch's side: serves the store on a free port of this host (``host``: the
    address the others reach it at), or, given ``address``, is a node supervisor's client
    of the store the outer launch serves; reads and writes the keys above. Neither imports
    torch (``store_server``: a server of torch's ``TCPStore`` protocol; ``store_client``: its client)."""

    def __init__(self, host: str = "127.0.0.1", address: str | None = None) -> None:
        from ddp_hpc.engine.recovery.store_client import StoreClient
        from ddp_hpc.engine.recovery.store_server import StoreServer

        self.server: StoreServer | None = None
        if address is None:
            self.server = StoreServer()
            self.address = f"{host}:{self.server.port}"
            self.store = StoreClient(host, self.server.port)
        else:
            host, _, port = address.rpartition(":")
            self.store, self.address = StoreClient(host, int(port), timeout=CONNECT_TIMEOUT_S), address

    def close(self) -> None:
        """Stops serving (the launch's own store), or leaves it (a node supervisor)."""
        self.store.close()
        if self.server is not None:
            self.server.close()

    def next_generation(self) -> int:
        """The generation of the next plan: one counter for every node supervisor."""
        return int(self.store.add(GENERATIONS_KEY, 1))

    def generations(self) -> int:
        """Plans published so far (recoveries, on every node)."""
        return int(self.store.add(GENERATIONS_KEY, 0))

    def publish(self, plan: Plan) -> None:
        """The plan, then ``latest`` raised to its generation (never lowered: a node
        supervisor that drew an older generation may publish after a newer one). The
        group before it is let go: its members waiting for one another (``formed``) see
        the newer plan instead of waiting for one that died."""
        self.store.set(plan_key(plan.generation), plan.to_json())
        self.store.set(formed_key(plan.generation - 1), "superseded")
        while True:
            current = self.store.get(LATEST_KEY).decode() if self.store.check([LATEST_KEY]) else ""
            if current and int(current) >= plan.generation:
                return
            if self.store.compare_set(LATEST_KEY, current, str(plan.generation)).decode() == str(plan.generation):
                return

    def request_stop(self, signum: int) -> None:
        """Every node supervisor passes ``signum`` on to its ranks (``stop_requested``)."""
        self.store.set(STOP_KEY, str(signum))

    def stop_requested(self) -> int | None:
        return int(self.store.get(STOP_KEY)) if self.store.check([STOP_KEY]) else None

    def given_up(self) -> str | None:
        """Why the ranks said they cannot recover (``give_up``), or None."""
        return self.store.get(GIVE_UP_KEY).decode() if self.store.check([GIVE_UP_KEY]) else None

    def snapshot_layout(self) -> dict | None:
        """A sharded model's snapshot layout (``publish_snapshots``), or None (DDP)."""
        return json.loads(self.store.get(SNAPSHOTS_KEY)) if self.store.check([SNAPSHOTS_KEY]) else None

    def beats(self, slot: int) -> int:
        return int(self.store.add(alive_key(slot), 0))

    def beats_of(self, slots: Sequence[int]) -> dict[int, int]:
        """``beats`` of each slot, in requests of ``KEYS_PER_REQUEST`` counters."""
        return read_beats(self.store, BEAT_KEYS, slots)

    def ready(self, slot: int) -> bool:
        return bool(self.store.check([ready_key(slot)]))

    def all_ready(self, slots: Iterable[int]) -> bool:
        """Every rank in ``slots`` runs InJobRecovery: one request a ``KEYS_PER_REQUEST``
        slots, stopping at the first with one missing."""
        return all(self.store.check(batch) for batch in store_batches([ready_key(slot) for slot in slots]))

    def not_ready(self, slots: Iterable[int]) -> list[int]:
        """The slots whose rank does not run InJobRecovery (one request a batch, then one a
        slot of the batches that miss one)."""
        missing = []
        for batch in store_batches([ready_key(slot) for slot in sorted(slots)]):
            if not self.store.check(batch):
                missing += [int(key.rpartition("/")[2]) for key in batch if not self.store.check([key])]
        return missing

    def assign(self, spare: str, slot: int) -> None:
        """The warm spare ``spare`` takes the place of the rank in ``slot`` (after ``publish``)."""
        self.store.set(spare_key(spare), str(slot))

    def recovered(self, generation: int) -> bool:
        return bool(self.store.check([recovered_key(generation)]))

    def forget(self, slot: int) -> None:
        """The rank in ``slot`` is gone: its replacement is ready once it says so itself."""
        self.store.delete_key(ready_key(slot))

"""One process of the recovery part of ``bench scale``: a few simulated ranks of a
``ddp-hpc launch --recover`` job, each a pair of threads against the launch's real store.

Each simulated rank does what ``InJobRecovery`` does with the store (engine/recovery/rank.py),
through the same functions of ``engine/recovery/store.py``: two clients (``connect``), its
``ready`` key set, a heartbeat thread calling ``beat`` every interval on one client, and a
main thread that, once its group is broken (the beat saw a newer plan, or the harness says
a collective failed, as gloo's error would), waits for the next plan (``wait_plan``), reads
``latest`` and notes when it holds the plan. One more thread per process reads its ranks'
``ready`` and ``alive`` keys every ``WATCH_S`` as a node supervisor does (``Recoverer.watch``,
through ``LaunchStore``). The lost rank of each recovery stops beating first.

Started by ``ddp_hpc.bench.scale_recovery`` with ``python -m``; one JSON object a line on
its standard streams, as ``scale_client``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from ddp_hpc.bench.store_calls import CountingStore
from ddp_hpc.engine.recovery import store as keys
from ddp_hpc.launch.recovering import WATCH_S

#: The store client's timeout and the plan's wait (``--recovery-wait``'s default).
WAIT_S = 120.0


class SimulatedRank:
    def __init__(self, slot: int, address: str, interval_s: float) -> None:
        self.slot, self.interval_s = slot, interval_s
        self.main = CountingStore(keys.connect(address, WAIT_S))
        self.beats = CountingStore(keys.connect(address, WAIT_S))
        self.main.set(keys.ready_key(slot), "1")
        self.generation = 0
        self.beat_count = 0
        self.held: dict[int, float] = {}
        self.errors: list[str] = []
        self.beating = threading.Event()
        self.lost = threading.Event()
        self.broken = threading.Event()
        self.waiting = threading.Event()
        self._lock = threading.Lock()

    def beat_loop(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(self.interval_s) and not self.lost.is_set():
                latest = keys.beat(self.beats, self.slot)
                self.beat_count += 1
                self.beating.set()
                with self._lock:
                    if latest > self.generation:
                        self.broken.set()  # recovery.py: _break_group(), and the rank's collective fails
        except Exception as exc:  # reported to the coordinator
            self.errors.append(f"beat: {type(exc).__name__}: {exc}")

    def recover_loop(self, stop: threading.Event) -> None:
        """recovery.py's ``_recover`` after a collective failed: the next plan, then the newest."""
        try:
            while True:
                self.broken.wait()
                if stop.is_set() or self.lost.is_set():
                    return
                self.waiting.set()
                plan = keys.wait_plan(self.main, self.generation + 1, WAIT_S)
                latest = int(self.main.get(keys.LATEST_KEY))
                if latest != plan.generation:
                    plan = keys.wait_plan(self.main, latest, WAIT_S)
                if self.slot not in plan.ranks:
                    raise RuntimeError(f"slot {self.slot} is not in the plan of generation {plan.generation}")
                with self._lock:
                    self.held[plan.generation] = time.time()
                    self.generation = plan.generation
                    self.waiting.clear()
                    self.broken.clear()
        except Exception as exc:
            self.errors.append(f"recover: {type(exc).__name__}: {exc}")


def watch_loop(store: keys.LaunchStore, slots: list[int], stop: threading.Event) -> None:
    """A node supervisor's reads each WATCH_S (``Recoverer.watch``): which of its ranks are
    ready, then their counters."""
    while not stop.wait(WATCH_S):
        missing = set(store.not_ready(slots))
        store.beats_of([slot for slot in slots if slot not in missing])


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    address, first, count, interval_s = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    slots = list(range(first, first + count))
    _say(event="ready", ranks=count)
    command = json.loads(sys.stdin.readline())
    ranks: dict[int, SimulatedRank] = {}
    errors: list[str] = []

    def connect(slot: int) -> None:
        try:
            ranks[slot] = SimulatedRank(slot, address, interval_s)
        except Exception as exc:
            errors.append(f"connect: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=connect, args=(slot,), daemon=True) for slot in slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        _say(event="connected", errors=errors[:3])
        return 1
    stop = threading.Event()
    time.sleep(max(0.0, command["go"] - time.time()))
    supervisor = keys.LaunchStore(address=address)
    supervisor.store = watch_store = CountingStore(supervisor.store)
    loops = [threading.Thread(target=watch_loop, args=(supervisor, slots, stop), daemon=True)]
    for rank in ranks.values():
        loops += [threading.Thread(target=rank.beat_loop, args=(stop,), daemon=True),
                  threading.Thread(target=rank.recover_loop, args=(stop,), daemon=True)]
    for thread in loops:
        thread.start()
    give_up_at = time.monotonic() + 60
    while not all(rank.beating.is_set() for rank in ranks.values()) and time.monotonic() < give_up_at:
        time.sleep(0.05)
    _say(event="connected", errors=[e for rank in ranks.values() for e in rank.errors][:3])
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "count":
            _say(event="counted", beats=sum(r.beat_count for r in ranks.values()),
                 beat_requests=sum(r.beats.calls for r in ranks.values()), watch=watch_store.calls)
        elif command["do"] == "lose":  # the lost rank stops beating (it is gone)
            if command["slot"] in ranks:
                ranks[command["slot"]].lost.set()
                ranks[command["slot"]].broken.set()
            _say(event="lost")
        elif command["do"] == "fail":  # every survivor's collective failed: they wait for the plan
            survivors = [r for r in ranks.values() if not r.lost.is_set()]
            for rank in survivors:
                rank.broken.set()
            give_up_at = time.monotonic() + 60
            while any(not (r.waiting.is_set() or r.errors) for r in survivors) and time.monotonic() < give_up_at:
                time.sleep(0.01)
            _say(event="failed", not_waiting=sum(not r.waiting.is_set() for r in survivors))
        elif command["do"] == "held":
            generation = command["generation"]
            give_up_at = time.monotonic() + command["timeout_s"]
            survivors = [r for r in ranks.values() if not r.lost.is_set()]
            while any(generation not in r.held for r in survivors) and time.monotonic() < give_up_at:
                time.sleep(0.01)
            _say(event="held", held={r.slot: r.held.get(generation) for r in survivors},
                 errors=[e for r in ranks.values() for e in r.errors][:3])
        elif command["do"] == "stop":
            break
    stop.set()
    for rank in ranks.values():
        rank.broken.set()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

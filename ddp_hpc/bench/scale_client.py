"""One process of the scale harness: a few simulated ranks, each a thread running ddp_hpc's
own rendezvous (``distributed.create_store``: connect, job marker, join gate) and then its
own ``liveness.Heartbeat``, against the one real store the coordinator serves.

Started by ``ddp_hpc.bench.scale`` with ``python -m`` (so torch is imported after the
exec, never inherited through a fork). It talks over its standard streams, one JSON object
a line: it says ``ready`` once imported, waits for ``go`` (an absolute time, shared by every
process so the ranks connect together), reports each rank's handshake time, runs the
heartbeats, answers ``hammer`` (store operations as fast as they go) and ends at ``stop``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from ddp_hpc.startup.distributed import create_store
from ddp_hpc.environment import DistEnv
from ddp_hpc.engine.liveness import Heartbeat

#: The handshake's time limit inside the harness (the default rendezvous_timeout_s).
RENDEZVOUS_TIMEOUT_S = 180.0
#: The variables the simulated ranks' store sees: none, as a rank launched without ddp_hpc's own.
STORE_ENVIRON: dict[str, str] = {}
OPS_KEY = "ddp_hpc_bench/ops"


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def rank_env(rank: int, world_size: int, ranks_per_node: int, addr: str, port: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, local_rank=rank % ranks_per_node,
                   local_world_size=ranks_per_node, node_rank=rank // ranks_per_node,
                   num_nodes=-(-world_size // ranks_per_node), master_addr=addr, master_port=port,
                   source="bench-scale")


def main(argv: list[str]) -> int:
    addr, port, world_size, first, count, interval_s, silent_raw = argv
    port_n, size, start, n = int(port), int(world_size), int(first), int(count)
    silent = {int(r) for r in silent_raw.split(",") if r}
    ranks = list(range(start, start + n))
    stores: dict[int, Any] = {}
    seconds: dict[int, float] = {}
    errors: dict[int, str] = {}
    _say(event="ready", ranks=n)

    command = json.loads(sys.stdin.readline())
    time.sleep(max(0.0, command["go"] - time.time()))

    def join(rank: int) -> None:
        began = time.perf_counter()
        try:
            stores[rank] = create_store(rank_env(rank, size, 8, addr, port_n), timedelta(seconds=600), STORE_ENVIRON,
                                        RENDEZVOUS_TIMEOUT_S)
            seconds[rank] = time.perf_counter() - began
        except Exception as exc:  # reported to the coordinator, which fails the run
            errors[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _say(event="joined", seconds=seconds, errors=errors, done_at=time.time())
    if errors:
        return 1

    beats = [Heartbeat(rank, size, f"node{rank // 8}", addr, port_n, interval_s=float(interval_s))
             for rank in ranks if rank not in silent]
    for heartbeat in beats:
        heartbeat.__enter__()
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "hammer":
            _say(event="hammered", ops=_hammer([stores[r] for r in ranks], command["go"], command["seconds"]))
        elif command["do"] == "stop":
            break
    for heartbeat in beats:
        heartbeat.__exit__(None, None, None)
    return 0


def _hammer(stores: list[Any], go: float, seconds: float) -> int:
    """Every rank's store client adds to one counter in a loop for ``seconds``; the count."""
    counts = [0] * len(stores)
    time.sleep(max(0.0, go - time.time()))
    end = time.monotonic() + seconds

    def loop(index: int) -> None:
        store = stores[index]
        while time.monotonic() < end:
            store.add(OPS_KEY, 1)
            counts[index] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

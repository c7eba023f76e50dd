"""The join gate's timeout diagnosis at large N: rank 0 listing the ranks that never joined.

    python benchmarks/gate_diagnosis.py --sizes 1024,4096,16384,50000

One real ``TCPStore`` in this process holds N ranks' joined keys and count, two ranks
(N/2 and N-1) and then a whole node of 8 left out. For each, it times ``absent_ranks`` (what
rank 0 runs at the gate's deadline) and counts its store round trips, next to the listing
it replaced (one ``check`` a rank). No clients: this is the diagnosis' cost, not the gate's.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch.distributed as dist

from ddp_hpc.bench.store_calls import CountingStore
from ddp_hpc.environment import DistEnv
from ddp_hpc.environment.ports import free_port
from ddp_hpc.startup.rendezvous import JOINED_KEY, absent_ranks


def measure(store: dist.Store, size: int, absent: list[int]) -> str:
    keys = [f"{JOINED_KEY}/{rank}" for rank in range(size)]
    store.multi_set(keys, [f"node{rank // 8}" for rank in range(size)])
    store.set(JOINED_KEY, str(size - len(absent)))
    for rank in absent:
        store.delete_key(keys[rank])
    env = DistEnv(rank=0, world_size=size, local_rank=0, local_world_size=8, node_rank=0,
                  num_nodes=-(-size // 8), master_addr="127.0.0.1", master_port=0, source="bench")
    counted = CountingStore(store)
    started = time.perf_counter()
    found = absent_ranks(counted, env)
    now_s = time.perf_counter() - started
    started = time.perf_counter()
    old = [rank for rank in range(size) if not store.check([keys[rank]])]
    old_s = time.perf_counter() - started
    assert found is not None and old == absent, (found, old)
    for rank in absent:
        store.set(keys[rank], f"node{rank // 8}")
    return (f"{size:>6}  {len(absent):>7}  {counted.calls:>11}  {now_s:>8.4f}  {size:>13}  {old_s:>8.4f}  "
            f"{found.ranks}; on {found.hosts or '(no host known: no node list here)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,16384,50000")
    sizes = [int(n) for n in parser.parse_args().sizes.split(",")]
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    print("ranks   missing  round trips  now (s)  before: trips  before (s)  the line")
    for size in sizes:
        print(measure(store, size, sorted({size // 2, size - 1})), flush=True)
        print(measure(store, size, list(range(size // 2, size // 2 + 8))), flush=True)


if __name__ == "__main__":
    main()

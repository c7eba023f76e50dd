"""torch's own TCPStore client against a store at 127.0.0.1:PORT (tests/test_store_server.py:
the launch's torch-free server): every request the torch here has, a PrefixStore, and a gloo
group of 2 formed over PrefixStores of it. Prints ``passed <torch version>``.

    python torch_store_client.py PORT            the checks, then the group (2 processes)
    python torch_store_client.py PORT RANK       one rank of the group
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

PORT = int(sys.argv[1])


def client(timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", PORT, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def expect_timeout(call, *args) -> float:
    started = time.monotonic()
    try:
        call(*args)
    except (dist.DistStoreError, RuntimeError) as exc:  # torch < 2.3 raises RuntimeError
        assert "timeout" in str(exc).lower() or "timed out" in str(exc).lower(), exc
        return time.monotonic() - started
    raise AssertionError(f"{call.__name__} did not time out")


def checks() -> None:
    store = client()
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2 and store.get("n") == b"2"
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.compare_set("a", "1", "2") == b"2" and store.get("a") == b"2"
    assert store.compare_set("a", "9", "3") == b"2"  # no match: the value stays, and is the answer
    assert store.compare_set("fresh", "", "x") == b"x" and store.get("fresh") == b"x"
    assert store.compare_set("absent", "e", "x") == b"e" and not store.check(["absent"])
    keys = store.num_keys()
    assert store.delete_key("a") and not store.delete_key("a") and store.num_keys() == keys - 1
    assert not store.check(["a"])
    store.wait(["n"])
    store.wait(["n", "fresh"], timedelta(seconds=5))
    # A wait that times out, then one the other client ends by setting its key.
    assert 0.4 < expect_timeout(store.wait, ["never"], timedelta(seconds=0.5)) < 10
    other = client()
    store.set("after", "ok")  # the connection still works after its wait was canceled
    assert other.get("after") == b"ok"
    waiter = subprocess.Popen([sys.executable, "-c", f"""
import time, torch.distributed as dist
from datetime import timedelta
time.sleep(0.5)
dist.TCPStore("127.0.0.1", {PORT}, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False).set("late", "L")
"""])
    started = time.monotonic()
    store.wait(["late", "n"])
    assert time.monotonic() - started >= 0.3 and store.get("late") == b"L"
    assert waiter.wait(60) == 0
    assert client(timeout_s=0.5).check(["late"])
    assert 0.4 < expect_timeout(client(timeout_s=0.5).get, "never") < 10  # a get waits for its key
    if hasattr(store, "append"):
        store.append("ap", "x")
        store.append("ap", "yz")
        assert store.get("ap") == b"xyz"
    if hasattr(store, "multi_set"):
        store.multi_set(["m1", "m2"], ["v1", b"v\x002"])
        assert store.multi_get(["m1", "m2"]) == [b"v1", b"v\x002"]
    if hasattr(store, "queue_push"):
        store.queue_push("q", "1")
        store.queue_push("q", "2")
        assert store.queue_len("q") == 2 and store.check(["q"])
        assert store.queue_pop("q") == b"1" and store.queue_pop("q", block=False) == b"2"
        assert store.queue_len("q") == 0
    prefixed = dist.PrefixStore("gen1/", store)
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v" and prefixed.add("c", 5) == 5 and prefixed.check(["k", "c"])
    assert not store.check(["k"]) and dist.PrefixStore("gen1/", other).get("k") == b"v"


def rank(rank: int) -> None:
    store = dist.PrefixStore("group/", client())
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    assert value.item() == 3.0, value
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        rank(int(sys.argv[2]))
        sys.exit(0)
    checks()
    ranks = [subprocess.Popen([sys.executable, __file__, str(PORT), str(r)]) for r in range(2)]
    statuses = [process.wait(120) for process in ranks]
    assert statuses == [0, 0], statuses
    print("passed", torch.__version__)

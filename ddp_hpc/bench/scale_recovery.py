"""The recovery part of ``ddp-hpc bench scale``: in-job recovery's store at N simulated ranks.

The launch of ``ddp-hpc launch --recover`` is a process of its own
(``scale_recovery_launch``): it serves the real ``LaunchStore`` (engine/recovery/store.py)
and, on a loss, makes the calls ``Recoverer.on_failure`` makes (``publish_after_loss``:
the recoveries counted, every rank's ``ready`` key asked, a generation drawn, the lost
rank forgotten, the ``Plan`` published). The N ranks are
threads of client processes (``scale_recovery_ranks``), each doing what ``InJobRecovery``
does with the store through the same functions (``beat`` at its default interval,
``wait_plan``), plus one node supervisor's reads per process (``Recoverer.watch``).

Measured per N: the store's load from the heartbeats (requests per second counted by the
clients, the launch process's CPU, where the store's server runs: it does nothing else
meanwhile); the time from a loss (the launch starts its calls) to every survivor holding
the new plan, once with the survivors learning of the loss from their heartbeat (a frozen
or distant peer: nothing failed in their own collectives) and once with every survivor
already waiting for the plan (gloo raised in their collective), with the launch's CPU
meanwhile (the store's share of that time: the rest is the clients' Python); and the bytes the store
moves for the launch per recovery, computed from the real objects for N ranks.
"""

from __future__ import annotations

import inspect
import json
import math
import socket
import sys
import time
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import Any

from ddp_hpc.bench.scale_harness import ADDR, Clients, fit_power_law, spread
from ddp_hpc.errors import UserError

#: Seconds over which the heartbeats' load is measured.
LOAD_WINDOW_S = 3.0
#: What each figure should grow like, and why (printed beside the fitted exponent).
EXPECTED = {
    "heartbeat_ops_per_s": "O(N): 2 requests a rank an interval",
    "watch_ops_per_s": "O(nodes): 3 requests a node supervisor (up to 256 ranks) a watch tick",
    "server_cpu_fraction": "O(N): the requests above",
    "server_us_per_request": "O(1): the store's CPU a request, whatever N",
    "polled_all_held_s": "O(1) + O(N) server time: one interval, then each survivor's wait and get",
    "waiting_all_held_s": "O(N) server time: one notification and one get a survivor",
    "waiting_server_cpu_s": "O(N): the store's CPU per recovery, 3 requests a survivor",
    "store_bytes_per_recovery": "O(N): a plan of O(changes) bytes read by N survivors",
    "plan_listing_every_slot_x_readers": "O(N^2): the plan as written before, every slot read by every rank",
}


def default_interval_s() -> float:
    """``InJobRecovery``'s default heartbeat interval."""
    from ddp_hpc.engine.recovery import InJobRecovery

    return float(inspect.signature(InJobRecovery.__init__).parameters["heartbeat_s"].default)


@dataclass(frozen=True)
class RecoveryRow:
    world_size: int
    processes: int
    interval_s: float
    beats_per_s: float
    requests_per_beat: float
    heartbeat_ops_per_s: float          # the ranks' beat requests
    watch_ops_per_s: float              # the node supervisors' ready/alive reads
    server_cpu_fraction: float          # of one core, the launch process (the store's server)
    polled: dict[str, Any]              # survivors learn of the loss from their heartbeat
    waiting: dict[str, Any]             # survivors already waiting for the plan
    bytes: dict[str, int]


def recovery_bytes(world_size: int) -> dict[str, int]:
    """Bytes the launch's store moves per recovery at ``world_size``, from the real objects:
    the plan as written (and in the form that listed every slot, for comparison) times the
    survivors that read it, their ``wait`` and ``get`` requests, and the launch's own
    question whether every rank is ready (its keys, in requests of 256)."""
    from ddp_hpc.engine.recovery.store import Plan, plan_key, ready_key

    members = {slot: slot for slot in range(world_size)}
    plan = Plan(generation=1, world_size=world_size, ranks=members, lost=world_size // 2, host=socket.gethostname(),
                cause="exit 137 (SIGKILL)", detected_at=time.time(), replaced=True)
    readers = world_size - 1
    written = len(plan.to_json())
    listed = len(json.dumps(asdict(plan)))
    requests = readers * 2 * len(plan_key(1))
    ready_scan = sum(len(ready_key(slot)) for slot in members)
    return {"plan": written, "plan_listing_every_slot": listed, "readers": readers,
            "plan_x_readers": written * readers, "plan_listing_every_slot_x_readers": listed * readers,
            "survivor_requests": requests, "launch_ready_scan": ready_scan,
            "store_bytes_per_recovery": written * readers + requests + ready_scan}


def publish_after_loss(launch: Any, members: dict[int, int], slot: int) -> Any:
    """The launch's calls on a loss with a replacement, as ``Recoverer.on_failure`` makes them."""
    from ddp_hpc.engine.recovery.store import Plan

    launch.generations()
    missing = launch.not_ready(members)
    if missing:
        raise UserError(f"scale harness: slots {missing[:5]} are not ready at the loss of {slot}")
    plan = Plan(generation=launch.next_generation(), world_size=len(members), ranks=dict(members), lost=slot,
                host=socket.gethostname(), cause="exit 137 (SIGKILL)", detected_at=time.time(), replaced=True)
    launch.forget(slot)
    launch.publish(plan)
    return plan


def measure_recovery(world_size: int, per_process: int, prefix: list[str] | None, interval_s: float | None = None,
                     progress: Callable[[str], None] = lambda _: None) -> RecoveryRow:
    interval = default_interval_s() if interval_s is None else interval_s
    launch = Clients([[sys.executable, "-m", "ddp_hpc.bench.scale_recovery_launch", ADDR, str(world_size)]], prefix)
    clients: Clients | None = None
    try:
        address = launch.read_all("ready", 300)[0]["address"]
        clients = Clients([[sys.executable, "-m", "ddp_hpc.bench.scale_recovery_ranks", address, str(first),
                             str(min(per_process, world_size - first)), str(interval)]
                            for first in range(0, world_size, per_process)], prefix)
        clients.read_all("ready", 900)
        clients.send(go=time.time() + 1.0 + 0.002 * world_size)
        errors = [e for m in clients.read_all("connected", 300 + 0.05 * world_size) for e in m["errors"]]
        if errors:
            raise UserError(f"scale harness: {len(errors)} simulated ranks failed: {errors[0]}")
        time.sleep(interval * 2)
        before, cpu0, t0 = _counts(clients), _launch_cpu_s(launch), time.monotonic()
        time.sleep(LOAD_WINDOW_S)
        after, cpu1, t1 = _counts(clients), _launch_cpu_s(launch), time.monotonic()
        seconds = t1 - t0
        rates = {name: (after[name] - before[name]) / seconds for name in ("beats", "beat_requests", "watch")}
        lost = [world_size // 2, world_size - 1] if world_size > 2 else [1, 1]
        progress(f"recovery: {world_size} ranks: {rates['beat_requests']:.0f} heartbeat requests/s, "
                 f"{(cpu1 - cpu0) / seconds:.3f} of a core for the store")
        polled = _recover(launch, clients, lost[0], fail_first=False, interval_s=interval)
        progress(f"recovery: {world_size} ranks, learned from the heartbeat: {json.dumps(polled)}")
        launch.send(do="replaced", slot=lost[0])
        launch.read_all("replaced", 60)
        waiting = _recover(launch, clients, lost[1], fail_first=True, interval_s=interval)
        progress(f"recovery: {world_size} ranks, every survivor waiting: {json.dumps(waiting)}")
        clients.send(do="stop")
    finally:
        if clients is not None:
            clients.close()
        launch.close()  # after the ranks: its store outlives them, as the launch's does
    return RecoveryRow(
        world_size=world_size, processes=len(clients.procs), interval_s=interval,
        beats_per_s=round(rates["beats"], 1),
        requests_per_beat=round(rates["beat_requests"] / max(rates["beats"], 1e-9), 3),
        heartbeat_ops_per_s=round(rates["beat_requests"]), watch_ops_per_s=round(rates["watch"]),
        server_cpu_fraction=round((cpu1 - cpu0) / seconds, 4), polled=polled, waiting=waiting,
        bytes=recovery_bytes(world_size))


def _launch_cpu_s(launch: Clients) -> float:
    launch.send(do="cpu")
    return float(launch.read_all("cpu", 60)[0]["cpu_s"])


def _counts(clients: Clients) -> dict[str, int]:
    clients.send(do="count")
    replies = clients.read_all("counted", 60)
    return {name: sum(m[name] for m in replies) for name in ("beats", "beat_requests", "watch")}


def _recover(launch: Clients, clients: Clients, slot: int, fail_first: bool,
             interval_s: float) -> dict[str, Any]:
    """One loss: the time from the launch's first call to each survivor holding the plan."""
    clients.send(do="lose", slot=slot)
    clients.read_all("lost", 60)
    if fail_first:
        clients.send(do="fail")
        clients.read_all("failed", 120)  # each survivor waits, or failed (its error is reported below)
        time.sleep(0.5)  # their wait requests reach the store
    launch.send(do="lose", slot=slot)
    published = launch.read_all("published", 120)[0]
    timeout = 60 + 20 * interval_s
    clients.send(do="held", generation=published["generation"], timeout_s=timeout)
    replies = clients.read_all("held", timeout + 60)
    server_cpu = _launch_cpu_s(launch) - published["cpu_s"]  # the store's server and the launch's calls
    held = [at for m in replies for at in m["held"].values()]
    errors = [e for m in replies for e in m["errors"]]
    times = [at - published["loss"] for at in held if at is not None]
    return {"generation": published["generation"], "survivors": len(held),
            "all_held": bool(held) and len(times) == len(held) and not errors,
            "publish_s": round(published["published"] - published["loss"], 4),
            "server_cpu_s": round(server_cpu, 4), "held_s": spread(times) if times else {},
            "errors": errors[:3]}


def growth_laws(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each figure's power law fitted over the rows (``a * N**b``) beside the law expected."""
    getters = {"heartbeat_ops_per_s": lambda r: r["heartbeat_ops_per_s"],
               "watch_ops_per_s": lambda r: r["watch_ops_per_s"],
               "server_cpu_fraction": lambda r: r["server_cpu_fraction"],
               "server_us_per_request": lambda r: 1e6 * r["server_cpu_fraction"]
               / max(r["heartbeat_ops_per_s"] + r["watch_ops_per_s"], 1),
               "polled_all_held_s": lambda r: r["polled"]["held_s"].get("max", 0),
               "waiting_all_held_s": lambda r: r["waiting"]["held_s"].get("max", 0),
               "waiting_server_cpu_s": lambda r: r["waiting"].get("server_cpu_s", 0),
               "store_bytes_per_recovery": lambda r: r["bytes"]["store_bytes_per_recovery"],
               "plan_listing_every_slot_x_readers": lambda r: r["bytes"]["plan_listing_every_slot_x_readers"]}
    sizes = [r["world_size"] for r in rows]
    laws = {}
    for name, getter in getters.items():
        fit = fit_power_law(sizes, [getter(r) for r in rows])
        laws[name] = {**fit, "expected": EXPECTED[name]}
    return laws


def format_recovery(rows: list[dict[str, Any]], laws: dict[str, dict[str, Any]]) -> str:
    lines = ["in-job recovery's store (the launch's): heartbeats at the default interval, a loss, the plan",
             "ranks  procs  beats/s  req/beat  hb req/s  watch req/s  server cpu  polled: publish s  all-held max s  "
             "waiting: all-held max s  server cpu s  all held  plan B  store B/recovery"]
    for row in rows:
        polled, waiting, b = row["polled"], row["waiting"], row["bytes"]
        lines.append(f"{row['world_size']:>5}  {row['processes']:>5}  {row['beats_per_s']:>7.1f}  "
                     f"{row['requests_per_beat']:>8.2f}  {row['heartbeat_ops_per_s']:>8}  {row['watch_ops_per_s']:>11}  "
                     f"{row['server_cpu_fraction']:>10.3f}  {polled['publish_s']:>17.4f}  "
                     f"{polled['held_s'].get('max', math.nan):>14.3f}  {waiting['held_s'].get('max', math.nan):>23.3f}  "
                     f"{waiting.get('server_cpu_s', math.nan):>12.3f}  "
                     f"{str(polled['all_held'] and waiting['all_held']):>8}  {b['plan']:>6}  "
                     f"{b['store_bytes_per_recovery']:>16}")
    for name, law in laws.items():
        fitted = f"{law['a']:.3g} x N^{law['b']:.2f}" if "b" in law else "not fitted (one size)"
        lines.append(f"growth of {name}: {fitted}; expected {law['expected']}")
    return "\n".join(lines)

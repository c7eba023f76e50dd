"""``ddp-hpc bench scale``: N simulated ranks against one real rendezvous store.

This process is rank 0: it serves the store through ddp_hpc's own ``create_store`` and
joins the gate like any rank. Ranks 1..N-1 are threads of a few client processes
(``ddp_hpc.bench.scale_client``, started with ``python -m`` so that torch is imported after
the exec, never through a fork), each running the real handshake and the real heartbeat.

Measured per N: the time from the common start until the gate opens, the store's
operations per second when every rank adds in a loop, the heartbeat's load at the default
interval (beats per second and this process's CPU, the store's server runs here), the
time of the silent-rank diagnosis (with two ranks made silent, checked to be named), the
time of the join gate's timeout diagnosis (the same two ranks' joined keys taken out), and
the bytes that reach rank 0 per quantity (start-up facts, run
record), computed from the objects the real code builds for N ranks. Then, with client
processes of its own, in-job recovery's store at the same sizes (``scale_recovery``).

Torch's store client looks up the store's address by name (``getnameinfo``) before each
connect. Where that address is not in /etc/hosts the look-up goes to DNS, and a burst of
them from one process loses replies here, each costing the resolver's 5 s timeout: the
stalls seen with many clients in one process. When run as root with ``unshare``, the
client processes get a private /etc/hosts that names the address, so the figures are the
store's and ddp_hpc's, not this machine's DNS (``dns_isolated`` in the results).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddp_hpc.bench.results_file import check_output, merge_into
from ddp_hpc.bench.scale_harness import ADDR, Clients, dns_isolation, fit_power_law, spread
from ddp_hpc.bench.scale_client import RENDEZVOUS_TIMEOUT_S, STORE_ENVIRON, rank_env
from ddp_hpc.environment.ports import free_port
from ddp_hpc.errors import UserError

#: The heartbeat interval ``watchdog()`` picks for the default distributed.watchdog_s (300 s).
DEFAULT_INTERVAL_S = 10.0
#: Simulated ranks per client process (memory: ~220 MB resident per process with torch).
RANKS_PER_PROCESS = 128
HAMMER_S = 5.0


@dataclass(frozen=True)
class ScaleRow:
    world_size: int
    processes: int
    dns_isolated: bool
    gate_open_s: float                 # common start -> rank 0 sees the gate open
    handshake_s: dict[str, float]      # per simulated rank: median, p99, max
    gate_server_cpu_s: float           # this process (the store's server) during the gate
    store_ops_per_s: float             # every rank's add() in a loop, HAMMER_S seconds
    heartbeat_interval_s: float
    heartbeat_beats_per_s: float       # measured over two intervals
    heartbeat_server_cpu_fraction: float  # of one core, this process
    store_connections: int             # handshake + heartbeat clients, as served
    diagnosis_s: float                 # Heartbeat.explain(), including its settle wait
    diagnosis_settle_s: float
    diagnosis_named_silent: bool
    gate_diagnosis_s: float            # rank 0's list of the ranks absent at the gate's time limit
    gate_diagnosis_named: bool
    rank0_bytes: dict[str, int]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rendezvous_clients(world_size: int, per_process: int, port: int, silent: list[int],
                        prefix: list[str] | None) -> Clients:
    return Clients([[sys.executable, "-m", "ddp_hpc.bench.scale_client", ADDR, str(port), str(world_size),
                     str(first), str(min(per_process, world_size - first)), str(DEFAULT_INTERVAL_S),
                     ",".join(map(str, silent))] for first in range(1, world_size, per_process)], prefix)


def _rank_environ(rank: int, world_size: int) -> dict[str, str]:
    """A plausible rank's variables: this process's, with the launcher's per-rank ones."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank % 8), "WORLD_SIZE": str(world_size),
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 8), "SLURM_NODEID": str(rank // 8),
            "SLURMD_NODENAME": f"node{rank // 8:05d}"}


def rank0_bytes(world_size: int) -> dict[str, int]:
    """Bytes reaching rank 0 per quantity at ``world_size``, from the objects the real code builds.

    ``gather_object`` pads every rank's pickle to the largest and first all-gathers the
    sizes (8 bytes a rank), so rank 0 receives ``N * (largest + 8)``.
    """
    from ddp_hpc.tracking.hub import startup_message
    from ddp_hpc.tracking.record import build_record, rank_facts
    from ddp_hpc.engine.rng import capture_rng

    def gathered(sizes: list[int]) -> int:
        return world_size * (max(sizes) + 8)

    facts = [rank_facts(rank_env(r, world_size, 8, ADDR, 29500).to_dict(), "cpu", "gloo",
                        _rank_environ(r, world_size)) for r in range(world_size)]
    sent = [startup_message(world_size, f) for f in facts]
    large = sent[0] is None
    # A large world sends rank 0 one float64 (the node count's all-reduce) instead.
    startup = 8 if large else gathered([len(pickle.dumps(m)) for m in sent])
    # No RNG state reaches rank 0 any more: each rank writes its streams to a file of its
    # own (engine/checkpoint/files.py, save_rank_part; dcp: its shard file). Its size is
    # reported as what every rank writes, not as what rank 0 receives.
    rng_file = len(pickle.dumps(capture_rng()))
    with tempfile.TemporaryDirectory() as tmp:
        record = build_record(run_path=Path(tmp), argv=["bench"], config={}, start_step=0, cwd=Path(tmp),
                              ranks=facts[:1] if large else facts, world_size=world_size,
                              rank_files="record/x.ranks" if large else None,
                              nodes=-(-world_size // 8) if large else None)
    return {"startup_facts": startup, "per_rank_rng_file": rng_file,
            "run_record": len(json.dumps(record, indent=1, sort_keys=True, default=str))}


def measure(world_size: int, per_process: int, prefix: list[str] | None,
            interval_s: float = DEFAULT_INTERVAL_S, with_bytes: bool = True) -> ScaleRow:
    import torch.distributed as dist

    from ddp_hpc.startup.distributed import create_store
    from ddp_hpc.engine.liveness import Heartbeat

    port = free_port()
    silent = sorted({world_size // 2, world_size - 1})
    clients = _rendezvous_clients(world_size, per_process, port, silent, prefix)
    try:
        clients.read_all("ready", 900)
        outcome: dict[str, Any] = {}

        def serve() -> None:
            try:
                outcome["store"] = create_store(rank_env(0, world_size, 8, ADDR, port), timedelta(seconds=600),
                                                STORE_ENVIRON, RENDEZVOUS_TIMEOUT_S)
                outcome["open_at"] = time.time()
            except Exception as exc:  # reported below
                outcome["error"] = exc

        gate_go = time.time() + 1.0 + 0.002 * world_size
        cpu0 = _cpu_s()
        rank0 = threading.Thread(target=serve, daemon=True)
        rank0.start()
        clients.send(go=gate_go)
        joined = clients.read_all("joined", RENDEZVOUS_TIMEOUT_S + 30)
        rank0.join(RENDEZVOUS_TIMEOUT_S + 30)
        if "error" in outcome:
            raise outcome["error"]
        gate_cpu = _cpu_s() - cpu0
        errors = [e for m in joined for e in m["errors"].values()]
        if errors:
            raise UserError(f"scale harness: {len(errors)} simulated ranks failed: {errors[0]}")
        handshakes = [s for m in joined for s in m["seconds"].values()]
        store: dist.Store = outcome["store"]

        # Heartbeats: every client process started them when its ranks had joined.
        keys = [f"ddp_hpc/heartbeat/{r}" for r in range(1, world_size) if r not in silent]
        time.sleep(interval_s * 1.5)   # every beating rank has connected and beaten
        before, cpu1, t1 = _beats(store, keys), _cpu_s(), time.monotonic()
        time.sleep(interval_s * 2)
        after, cpu2, t2 = _beats(store, keys), _cpu_s(), time.monotonic()
        beats_per_s = (after - before) / (t2 - t1)
        heartbeat_cpu = (cpu2 - cpu1) / (t2 - t1)
        connections = _connections(port)

        watcher = Heartbeat(0, world_size, socket.gethostname(), ADDR, port, interval_s=interval_s)
        with watcher:
            started = time.perf_counter()
            verdict = watcher.explain()
            diagnosis_s = time.perf_counter() - started
        named = all(f" {r}" in verdict or f",{r}" in verdict for r in silent) and "silent" in verdict
        gate_diagnosis_s, gate_named = _gate_diagnosis(store, world_size, silent)

        clients.send(do="hammer", go=time.time() + 1.0, seconds=HAMMER_S)
        ops = sum(m["ops"] for m in clients.read_all("hammered", HAMMER_S + 120))
        clients.send(do="stop")
    finally:
        clients.close()
    return ScaleRow(
        world_size=world_size, processes=len(clients.procs), dns_isolated=prefix is not None,
        gate_open_s=round(outcome["open_at"] - gate_go, 3),
        handshake_s=spread(handshakes), gate_server_cpu_s=round(gate_cpu, 3),
        store_ops_per_s=round(ops / HAMMER_S), heartbeat_interval_s=interval_s,
        heartbeat_beats_per_s=round(beats_per_s, 1), heartbeat_server_cpu_fraction=round(heartbeat_cpu, 4),
        store_connections=connections, diagnosis_s=round(diagnosis_s, 2),
        diagnosis_settle_s=watcher.settle_s, diagnosis_named_silent=named,
        gate_diagnosis_s=round(gate_diagnosis_s, 4), gate_diagnosis_named=gate_named,
        rank0_bytes=rank0_bytes(world_size) if with_bytes else {})


def _gate_diagnosis(store: Any, world_size: int, absent: list[int]) -> tuple[float, bool]:
    """The join gate's timeout diagnosis at ``world_size``, timed, with ``absent`` taken out of
    the joined keys (they joined to let the run go on): (seconds, whether it named them)."""
    from ddp_hpc.startup.rendezvous import JOINED_KEY, absent_ranks, rank_ranges

    for rank in absent:
        store.delete_key(f"{JOINED_KEY}/{rank}")
    store.add(JOINED_KEY, -len(absent))  # the count of joined ranks, as if they never had
    started = time.perf_counter()
    found = absent_ranks(store, rank_env(0, world_size, 8, ADDR, 0))
    seconds = time.perf_counter() - started
    named = found is not None and found.ranks == f"ranks {rank_ranges(absent)} ({len(absent)} of {world_size})"
    return seconds, named


def _beats(store: Any, keys: list[str]) -> int:
    """The sum of the given heartbeat counters (one batched read)."""
    return sum(int(value) for value in store.multi_get(keys))


def _connections(port: int) -> int:
    """Established connections the store's port holds (``ss``), or -1 when it cannot tell."""
    if shutil.which("ss") is None:
        return -1
    result = subprocess.run(["ss", "-Htn", "state", "established", f"sport = :{port}"], capture_output=True,
                            text=True, timeout=60)
    return len(result.stdout.splitlines()) if result.returncode == 0 else -1


def run_scale(sizes: tuple[int, ...], output: Path, per_process: int = RANKS_PER_PROCESS,
              check_size: int | None = 32) -> dict[str, Any]:
    """Every size in turn, the separate-process check, fits; merged into ``output``'s "scale" key."""
    check_output(output)
    def progress(message: str) -> None:
        print(f"bench scale: {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="ddp-hpc-scale-") as tmp:
        prefix = dns_isolation(Path(tmp))
        progress("client DNS isolated (private /etc/hosts)" if prefix else
                 "client DNS NOT isolated (not root or no unshare): expect resolver stalls")
        rows, failed = [], {}
        for size in sizes:
            progress(f"{size} ranks ({math.ceil((size - 1) / per_process)} client processes)")
            try:
                rows.append(measure(size, per_process, prefix))
            except (UserError, OSError, RuntimeError) as exc:  # the machine's limit: keep what ran
                failed = {"world_size": size, "error": str(exc).splitlines()[0][:300]}
                progress(f"{size} ranks failed, larger sizes skipped: {failed['error']}")
                break
            progress(json.dumps(asdict(rows[-1])))
        recovery = _recovery_part(sizes, per_process, prefix, progress)
        check: dict[str, Any] = {}
        if check_size:
            progress(f"check: {check_size} ranks as separate processes, then {per_process} per process")
            separate = measure(check_size, 1, prefix, with_bytes=False)
            shared = measure(check_size, per_process, prefix, with_bytes=False)
            check = {"world_size": check_size, "separate_processes": asdict(separate),
                     "threads_in_processes": asdict(shared)}
    load = os.getloadavg()
    grown = [r for r in rows if r.world_size >= 256] or rows
    fits = {name: fit_power_law([r.world_size for r in grown], [getter(r) for r in grown])
            for name, getter in (("gate_open_s", lambda r: r.gate_open_s),
                                 ("gate_server_cpu_s", lambda r: r.gate_server_cpu_s),
                                 ("heartbeat_server_cpu_fraction", lambda r: r.heartbeat_server_cpu_fraction),
                                 ("diagnosis_read_s", lambda r: max(r.diagnosis_s - r.diagnosis_settle_s, 1e-4)))}
    section = {"command": "ddp-hpc bench scale " + ",".join(map(str, sizes)),
               "ranks_per_process": per_process, "load_average_at_end": load,
               "rows": [asdict(r) for r in rows], "failed": failed, "check": check, "fits": fits,
               "extrapolated_50000": {name: fit["a"] * 50000 ** fit["b"] for name, fit in fits.items() if fit},
               "recovery": recovery}
    merge_into(output, {"scale": section})
    print(format_scale(section))
    from ddp_hpc.bench.scale_recovery import format_recovery

    print(format_recovery(recovery["rows"], recovery["laws"]))
    return section


def _recovery_part(sizes: tuple[int, ...], per_process: int, prefix: list[str] | None,
                   progress: Any) -> dict[str, Any]:
    """In-job recovery's store at each size (``scale_recovery``), its own client processes."""
    from ddp_hpc.bench.scale_recovery import growth_laws, measure_recovery

    rows: list[dict[str, Any]] = []
    failed: dict[str, Any] = {}
    for size in sizes:
        progress(f"recovery: {size} ranks ({math.ceil(size / per_process)} client processes)")
        try:
            rows.append(asdict(measure_recovery(size, per_process, prefix, progress=progress)))
        except (UserError, OSError, RuntimeError) as exc:  # the machine's limit: keep what ran
            failed = {"world_size": size, "error": str(exc).splitlines()[0][:300]}
            progress(f"recovery: {size} ranks failed, larger sizes skipped: {failed['error']}")
            break
        progress(json.dumps(rows[-1]))
    return {"rows": rows, "failed": failed, "laws": growth_laws(rows)}


def format_scale(section: dict[str, Any]) -> str:
    lines = ["ranks  procs  gate-open s  handshake p99 s  ops/s  beats/s  hb cpu  conns  diagnosis s  named  "
             "gate diag s  start-up B  record B  (rank's own rng file B)"]
    for row in section["rows"]:
        b = row["rank0_bytes"]
        lines.append(f"{row['world_size']:>5}  {row['processes']:>5}  {row['gate_open_s']:>11.3f}  "
                     f"{row['handshake_s']['p99']:>15.3f}  {row['store_ops_per_s']:>5}  "
                     f"{row['heartbeat_beats_per_s']:>7.1f}  {row['heartbeat_server_cpu_fraction']:>6.3f}  "
                     f"{row['store_connections']:>5}  {row['diagnosis_s']:>11.2f}  "
                     f"{str(row['diagnosis_named_silent']):>5}  {row['gate_diagnosis_s']:>11.4f}  "
                     f"{b.get('startup_facts', 0):>10}  "
                     f"{b.get('run_record', 0):>8}  {b.get('per_rank_rng_file', 0):>6}")
    for name, value in section["extrapolated_50000"].items():
        lines.append(f"extrapolated to 50,000 ranks (power law fitted to the rows): {name} = {value:.4g}")
    return "\n".join(lines)

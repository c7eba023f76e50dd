"""``ddp-hpc doctor --links``: point-to-point bandwidth and latency between the job's hosts.

One rank per host (the lowest rank there) takes part; the others wait at a barrier. Each
measured link runs one after another, so that no two share a host's interface:

- up to ``ALL_PAIRS_MAX_HOSTS`` hosts, every pair (N(N-1)/2 pairs);
- above, a ring: host i with host i+1 (N pairs), and a host's two neighbours say which of
  its links is slow.

Each pair measures both directions: one untimed message each way, ``LATENCY_ROUNDS`` round
trips of one float (latency: half the median round trip), then ``BANDWIDTH_ROUNDS`` messages
of ``message_bytes`` each way, the directions taking turns, each acknowledged by one float
(bandwidth: the best round). A directed link
is slow when its bandwidth is below ``SLOW_FRACTION`` of the median of all directed links
(or below ``--min-bandwidth``), or its latency above ``1 / SLOW_FRACTION`` times the median
and ``LATENCY_FLOOR_US``. A pair with a slow direction is measured again, up to
``CONFIRM_TRIES`` times, each direction keeping its best bandwidth and latency of all tries:
only a link slow in every try is slow (a burst of other work on a host slows one try; a bad
cable or port slows all). A host that sends (or receives) on every slow link is named.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ddp_hpc.startup.distributed import DistContext

ALL_PAIRS_MAX_HOSTS = 8
LATENCY_ROUNDS = 20
BANDWIDTH_ROUNDS = 5
DEFAULT_MESSAGE_BYTES = 4 << 20
SLOW_FRACTION = 0.5
#: Latency differences below this are noise between processes (scheduling), not links.
LATENCY_FLOOR_US = 500.0
#: How many more times a pair with a slow direction is measured before the link is called slow.
CONFIRM_TRIES = 2


@dataclass(frozen=True)
class LinkPlan:
    """Which host pairs are measured, and what the measurement costs."""

    hosts: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]
    shape: str
    message_bytes: int

    @property
    def cost(self) -> str:
        messages = BANDWIDTH_ROUNDS + 1  # the first one untimed
        per_pair = 2 * messages * self.message_bytes / 2**20
        return (f"{self.shape}: {len(self.pairs)} pair(s) of {len(self.hosts)} hosts, one after another; "
                f"each pair {2 * LATENCY_ROUNDS} round trips and {per_pair:g} MiB ({messages} x "
                f"{self.message_bytes / 2**20:g} MiB each way), a slow pair up to {CONFIRM_TRIES} more times")


def plan_links(hosts: Sequence[str], message_bytes: int = DEFAULT_MESSAGE_BYTES) -> LinkPlan:
    count = len(hosts)
    if count <= ALL_PAIRS_MAX_HOSTS:
        pairs = tuple((a, b) for a in range(count) for b in range(a + 1, count))
        shape = "every pair"
    else:
        pairs = tuple((i, (i + 1) % count) for i in range(count))
        shape = f"a ring (more than {ALL_PAIRS_MAX_HOSTS} hosts)"
    return LinkPlan(tuple(hosts), pairs, shape, message_bytes)


@dataclass(frozen=True)
class LinkResult:
    """One direction of one link: ``src`` sends to ``dst``."""

    src: str
    dst: str
    bandwidth_mb_s: float
    latency_us: float


@dataclass(frozen=True)
class LinkVerdict:
    results: tuple[LinkResult, ...]
    slow: tuple[tuple[LinkResult, str], ...]
    suspects: tuple[str, ...]

    @property
    def healthy(self) -> bool:
        return not self.slow

    @property
    def fine(self) -> set[tuple[str, str]]:
        """The directed links (src, dst) not judged slow."""
        return {(r.src, r.dst) for r in self.results} - {(r.src, r.dst) for r, _ in self.slow}


def judge_links(results: Sequence[LinkResult], min_bandwidth_mb_s: float | None = None) -> LinkVerdict:
    """The slow directed links (with why) and the hosts they have in common."""
    if not results:
        return LinkVerdict((), (), ())
    median_bw = statistics.median(r.bandwidth_mb_s for r in results)
    median_lat = statistics.median(r.latency_us for r in results)
    slow: list[tuple[LinkResult, str]] = []
    for result in results:
        reasons = []
        bandwidth, latency = result.bandwidth_mb_s, result.latency_us
        if bandwidth < SLOW_FRACTION * median_bw:
            reasons.append(f"{bandwidth:.1f} MB/s, {bandwidth / median_bw:.2f}x the median {median_bw:.1f} MB/s")
        elif min_bandwidth_mb_s is not None and bandwidth < min_bandwidth_mb_s:
            reasons.append(f"{bandwidth:.1f} MB/s, below --min-bandwidth {min_bandwidth_mb_s:g} MB/s")
        if latency > max(median_lat / SLOW_FRACTION, LATENCY_FLOOR_US):
            reasons.append(f"latency {latency:.0f} us, {latency / median_lat:.1f}x the median {median_lat:.0f} us")
        if reasons:
            slow.append((result, "; ".join(reasons)))
    return LinkVerdict(tuple(results), tuple(slow), _suspects([r for r, _ in slow]))


def best_of(tries: Sequence[Sequence[LinkResult]]) -> list[LinkResult]:
    """Each directed link once, with its best bandwidth and lowest latency over ``tries``
    (in the order of its first appearance)."""
    best: dict[tuple[str, str], LinkResult] = {}
    for results in tries:
        for r in results:
            seen = best.get((r.src, r.dst))
            best[(r.src, r.dst)] = r if seen is None else LinkResult(
                r.src, r.dst, max(seen.bandwidth_mb_s, r.bandwidth_mb_s), min(seen.latency_us, r.latency_us))
    return list(best.values())


def _suspects(slow: Sequence[LinkResult]) -> tuple[str, ...]:
    """Hosts on every slow link: senders first (a slow send is the sender's interface or
    its switch port more often than not), then receivers."""
    if not slow:
        return ()
    senders = Counter(r.src for r in slow)
    receivers = Counter(r.dst for r in slow)
    named = [host for host, count in senders.most_common() if count == len(slow)]
    named += [host for host, count in receivers.most_common() if count == len(slow) and host not in named]
    if not named:  # no host in common: every host on a slow link, most often first
        named = [host for host, _ in (senders + receivers).most_common()]
    return tuple(named)


def format_links(plan: LinkPlan, verdict: LinkVerdict, elapsed_s: float) -> str:
    if len(plan.hosts) < 2:
        return f"links: nothing to measure: every rank runs on {plan.hosts[0] if plan.hosts else 'one host'}"
    width = max(4, *(len(h) for h in plan.hosts))
    lines = [f"links: {plan.cost}; took {elapsed_s:.1f} s",
             f"{'from'.ljust(width)}  {'to'.ljust(width)}  {'MB/s':>9}  {'latency us':>10}"]
    for r in verdict.results:
        lines.append(f"{r.src.ljust(width)}  {r.dst.ljust(width)}  {r.bandwidth_mb_s:9.1f}  "
                     f"{r.latency_us:10.0f}")
    if verdict.healthy:
        lines.append(f"links: OK: {len(verdict.results)} directed link(s) between {len(plan.hosts)} hosts, "
                     f"none slow")
        return "\n".join(lines)
    for result, why in verdict.slow:
        lines.append(f"links: SLOW: {result.src} -> {result.dst}: {why}")
    ambiguous = "" if len(plan.hosts) > 2 else "; with 2 hosts the sender and the receiver cannot be told apart"
    lines.append(f"links: FAILED: suspect host(s): {', '.join(verdict.suspects)} (on every slow link{ambiguous})")
    return "\n".join(lines)


# --- the measurement (torch) --------------------------------------------------------------

def host_leaders(hosts_by_rank: Sequence[str]) -> tuple[list[str], list[int]]:
    """The job's hosts in rank order and the lowest rank on each."""
    hosts: list[str] = []
    leaders: list[int] = []
    for rank, host in enumerate(hosts_by_rank):
        if host not in hosts:
            hosts.append(host)
            leaders.append(rank)
    return hosts, leaders


def _measure_pair(rank: int, a: int, b: int, message_bytes: int,
                  device: torch.device) -> tuple[float, float]:
    """Both directions of the link between ranks ``a`` and ``b`` (this rank is one of them):
    (bandwidth MB/s, latency us) for the direction this rank sends in.

    One untimed message each way first (connections, allocations). The directions take
    turns round by round, so both see the same load on the hosts, and each keeps its best
    round: a rank descheduled for a moment slows one round, not the verdict. Tensors live
    on the rank's device (nccl/xccl send only those); accelerators are synchronized before
    a time is read, since their send/recv only enqueue work.
    """
    import torch
    import torch.distributed as dist

    peer = b if rank == a else a
    accelerator = getattr(torch, device.type, None) if device.type in ("cuda", "xpu") else None

    def recv(tensor) -> None:
        dist.recv(tensor, peer)
        if accelerator is not None:
            accelerator.synchronize()

    token = torch.zeros(1, device=device)
    payload = torch.ones(max(1, message_bytes // 4), device=device)

    def timed(sender: int, tensor, rounds: int) -> list[float]:
        """``rounds`` messages from ``sender``, each answered by a token; times on the sender."""
        seconds = []
        for _ in range(rounds):
            if rank == sender:
                started = time.perf_counter()
                dist.send(tensor, peer)
                recv(token)
                seconds.append(time.perf_counter() - started)
            else:
                recv(tensor)
                dist.send(token, peer)
        return seconds

    for sender in (a, b):
        timed(sender, payload, 1)  # warm-up
    round_trips = {sender: timed(sender, token, LATENCY_ROUNDS) for sender in (a, b)}[rank]
    transfers = [t for _ in range(BANDWIDTH_ROUNDS) for sender in (a, b) for t in timed(sender, payload, 1)]
    bandwidth = message_bytes / min(transfers) / 1e6
    return bandwidth, statistics.median(round_trips) / 2 * 1e6


def _measure_pairs(ctx: DistContext, hosts: Sequence[str], leaders: Sequence[int],
                   pairs: Sequence[tuple[int, int]], message_bytes: int) -> list[LinkResult]:
    """Both directions of each pair, one pair at a time (collective); every rank gets all."""
    import torch.distributed as dist

    mine: list[LinkResult] = []
    for a, b in pairs:
        if ctx.rank in (leaders[a], leaders[b]):
            me, other = (a, b) if ctx.rank == leaders[a] else (b, a)
            bandwidth, latency = _measure_pair(ctx.rank, leaders[a], leaders[b], message_bytes,
                                               ctx.torch_device)
            mine.append(LinkResult(hosts[me], hosts[other], bandwidth, latency))
        if ctx.group_initialized:
            dist.barrier()  # one link at a time
    return [r for per_rank in ctx.all_gather_object(mine) for r in per_rank]


def measure_links(ctx: DistContext, hosts_by_rank: Sequence[str], *, message_bytes: int = DEFAULT_MESSAGE_BYTES,
                  min_bandwidth_mb_s: float | None = None) -> tuple[LinkPlan, LinkVerdict, float]:
    """Measure the plan's links (collective: every rank calls it); the verdict on every rank.

    Pairs with a slow direction are measured again (up to ``CONFIRM_TRIES`` times), each
    direction keeping its best of all tries; every rank derives the same pairs from the same
    gathered results, so all take part in the same measurements.
    """
    hosts, leaders = host_leaders(hosts_by_rank)
    plan = plan_links(hosts, message_bytes)
    started = time.perf_counter()
    tries: list[list[LinkResult]] = []
    pairs: Sequence[tuple[int, int]] = plan.pairs
    #: Links judged fine once: a median raised by a link measured again does not make them slow.
    fine: set[tuple[str, str]] = set()
    for _ in range(1 + CONFIRM_TRIES):
        tries.append(_measure_pairs(ctx, hosts, leaders, pairs, message_bytes))
        verdict = _slow_in_every_try(judge_links(best_of(tries), min_bandwidth_mb_s), fine)
        fine |= verdict.fine
        if verdict.healthy:
            break
        slow_hosts = {frozenset((r.src, r.dst)) for r, _ in verdict.slow}
        pairs = [(a, b) for a, b in plan.pairs if frozenset((hosts[a], hosts[b])) in slow_hosts]
    order = {(hosts[a], hosts[b]): i for i, (a, b) in enumerate(p for pair in plan.pairs
                                                                  for p in (pair, pair[::-1]))}
    results = sorted(verdict.results, key=lambda r: order[(r.src, r.dst)])
    slow = sorted(verdict.slow, key=lambda item: order[(item[0].src, item[0].dst)])
    return plan, LinkVerdict(tuple(results), tuple(slow), verdict.suspects), time.perf_counter() - started


def _slow_in_every_try(verdict: LinkVerdict, fine: set[tuple[str, str]]) -> LinkVerdict:
    slow = tuple((r, why) for r, why in verdict.slow if (r.src, r.dst) not in fine)
    return LinkVerdict(verdict.results, slow, _suspects([r for r, _ in slow]))

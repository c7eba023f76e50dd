"""``doctor --links`` arithmetic (ddp_hpc.startup.links): which pairs are measured, what is slow and
which host is named. The measurement across real hosts: tests/test_multihost.py."""

from __future__ import annotations

import pytest

from ddp_hpc.startup.links import (ALL_PAIRS_MAX_HOSTS, LinkResult, format_links, host_leaders, judge_links,
                           plan_links)


def test_every_pair_for_few_hosts_a_ring_above_with_the_cost_stated():
    few = plan_links([f"h{i}" for i in range(4)])
    assert few.pairs == ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
    assert few.cost.startswith("every pair: 6 pair(s) of 4 hosts, one after another; each pair 40 round trips "
                               "and 48 MiB (6 x 4 MiB each way)")
    many = plan_links([f"h{i}" for i in range(ALL_PAIRS_MAX_HOSTS + 2)], message_bytes=1 << 20)
    assert many.pairs == tuple((i, (i + 1) % 10) for i in range(10))
    assert many.cost.startswith("a ring (more than 8 hosts): 10 pair(s) of 10 hosts")


def test_one_leader_per_host_in_rank_order():
    assert host_leaders(["a", "a", "b", "b", "c"]) == (["a", "b", "c"], [0, 2, 4])


def link(src: str, dst: str, mb_s: float, us: float = 100.0) -> LinkResult:
    return LinkResult(src, dst, mb_s, us)


def test_the_host_on_every_slow_link_is_named():
    results = [link("h1", "h2", 1000), link("h2", "h1", 990), link("h1", "h3", 1010), link("h3", "h1", 80),
               link("h2", "h3", 1005), link("h3", "h2", 75)]
    verdict = judge_links(results)
    assert not verdict.healthy
    assert [(r.src, r.dst) for r, _ in verdict.slow] == [("h3", "h1"), ("h3", "h2")]
    assert verdict.suspects == ("h3",)
    text = format_links(plan_links(["h1", "h2", "h3"]), verdict, 1.0)
    assert "links: SLOW: h3 -> h1: 80.0 MB/s, 0.08x the median 995.0 MB/s" in text
    assert text.splitlines()[-1] == "links: FAILED: suspect host(s): h3 (on every slow link)"


def test_even_links_pass_and_latency_or_a_floor_can_fail_them():
    even = [link("a", "b", 1000), link("b", "a", 900), link("a", "c", 950), link("c", "a", 980),
            link("b", "c", 1000), link("c", "b", 1000)]
    assert judge_links(even).healthy
    assert "links: OK: 6 directed link(s) between 3 hosts, none slow" in format_links(plan_links("abc"),
                                                                                      judge_links(even), 1.0)
    assert not judge_links(even, min_bandwidth_mb_s=950).healthy
    laggy = [*even[:-1], link("c", "b", 1000, us=5000)]
    verdict = judge_links(laggy)
    assert [why for _, why in verdict.slow] == ["latency 5000 us, 50.0x the median 100 us"]
    # Small latency differences are noise between processes, not a slow link.
    assert judge_links([*even[:-1], link("c", "b", 1000, us=400)]).healthy


def test_one_host_has_nothing_to_measure():
    assert format_links(plan_links(["vm"]), judge_links([]), 0.0) == \
        "links: nothing to measure: every rank runs on vm"


class _SeenFromOneRank:
    """One rank of a job whose gather brings the other ranks' measurements of each try
    (``others``: one list of ``LinkResult`` per try) beside this rank's own."""

    group_initialized = False
    torch_device = "cpu"

    def __init__(self, rank: int, others: list[list[LinkResult]]):
        self.rank, self.others, self.gathers = rank, list(others), 0

    def all_gather_object(self, mine):
        self.gathers += 1
        return [mine, self.others.pop(0)]


def _measured(monkeypatch, peer_mb_s: list[float]):
    """Rank 0 of 2 hosts: it measures h1 -> h2 (1000 MB/s each try); h2 -> h1 comes from ``peer_mb_s``."""
    from ddp_hpc.startup import links

    tries = []
    monkeypatch.setattr(links, "_measure_pair", lambda *_: tries.append(1) or (1000.0, 100.0))
    ctx = _SeenFromOneRank(0, [[LinkResult("h2", "h1", mb_s, 100.0)] for mb_s in peer_mb_s])
    plan, verdict, _ = links.measure_links(ctx, ["h1", "h2"])
    assert ctx.gathers == len(tries)  # one gather per try
    return verdict, len(tries)


def test_a_link_slow_once_is_measured_again_and_only_one_slow_in_every_try_is_slow(monkeypatch):
    from ddp_hpc.startup.links import CONFIRM_TRIES

    # A burst of other work on h2 during the first try: the second finds the link fine.
    verdict, tries = _measured(monkeypatch, [150.0, 950.0])
    assert verdict.healthy and tries == 2
    assert [(r.src, r.dst, r.bandwidth_mb_s) for r in verdict.results] == [("h1", "h2", 1000.0), ("h2", "h1", 950.0)]
    # A rate-limited h2: slow in every try, named, after 1 + CONFIRM_TRIES tries.
    verdict, tries = _measured(monkeypatch, [12.0, 14.0, 12.5][:1 + CONFIRM_TRIES])
    assert not verdict.healthy and tries == 1 + CONFIRM_TRIES
    assert [(r.src, r.dst) for r, _ in verdict.slow] == [("h2", "h1")]
    assert verdict.slow[0][0].bandwidth_mb_s == 14.0  # the best of the tries
    # A healthy first try is the only one.
    assert _measured(monkeypatch, [990.0])[1] == 1


def test_a_rank_that_measures_nothing_takes_part_in_every_try_and_a_link_fine_once_stays_fine(monkeypatch):
    """Rank 1 of 3 hosts (h1 has ranks 0 and 1: rank 1 leads no host) measures nothing and
    still joins every try's gather: h3's sends are slow in try 1, fine in try 2. In try 2 the
    fast links raise the median above the h1 <-> h2 links measured once: those stay fine."""
    from ddp_hpc.startup import links

    monkeypatch.setattr(links, "_measure_pair", lambda *_: pytest.fail("rank 1 measures no link"))
    first = [link("h1", "h2", 600), link("h2", "h1", 600), link("h1", "h3", 1000), link("h3", "h1", 100),
             link("h2", "h3", 1000), link("h3", "h2", 100)]
    second = [link("h1", "h3", 1500), link("h3", "h1", 1500), link("h2", "h3", 1500), link("h3", "h2", 1500)]
    ctx = _SeenFromOneRank(1, [first, second])
    plan, verdict, _ = links.measure_links(ctx, ["h1", "h1", "h2", "h3"])
    assert ctx.gathers == 2 and verdict.healthy, verdict.slow
    assert [(r.src, r.dst, r.bandwidth_mb_s) for r in verdict.results] == [
        ("h1", "h2", 600), ("h2", "h1", 600), ("h1", "h3", 1500), ("h3", "h1", 1500), ("h2", "h3", 1500),
        ("h3", "h2", 1500)]
    assert not judge_links(verdict.results).healthy  # judged afresh, 600 is under half the median 1500

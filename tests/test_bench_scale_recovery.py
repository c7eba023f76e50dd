"""The recovery part of ``bench scale`` at a tiny size, and the store costs it measures:
a plan whose size does not grow with the ranks, a beat of two requests, the launch's
readiness question in batches."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_recovery_part_reports_every_figure_and_every_survivor_holds_each_plan():
    from ddp_hpc.bench.scale_recovery import RecoveryRow, format_recovery, growth_laws, measure_recovery

    row = measure_recovery(6, 3, None)  # two client processes of three simulated ranks
    assert all(getattr(row, field.name) not in (None, {}, 0) for field in fields(RecoveryRow)), row
    # Requests counted over a window of beats: a beat cut by the window's ends counts part of
    # its two (seen 1.89 under load; fewer beats under more load skew it more). The exact
    # count is the next-but-one test's.
    assert 1.5 <= row.requests_per_beat <= 2.5, row.requests_per_beat
    for loss, survivors in ((row.polled, 5), (row.waiting, 4)):
        assert loss["all_held"] and loss["survivors"] == survivors and not loss["errors"], loss
        assert {"median", "p99", "max"} <= loss["held_s"].keys()
    rows = [json.loads(json.dumps(row.__dict__))]
    laws = growth_laws(rows)
    text = format_recovery(rows, laws)
    assert "all held" in text and "True" in text.splitlines()[2]
    assert all(name in text for name in laws)


def test_the_plan_is_as_large_at_4096_ranks_as_at_8_and_reads_back_the_same():
    from ddp_hpc.engine.recovery.store import Plan

    def plan(slots: list[int]) -> Plan:
        return Plan(generation=3, world_size=len(slots), ranks={slot: rank for rank, slot in enumerate(slots)},
                    lost=5, host="node1", cause="exit 137 (SIGKILL)", detected_at=1.5, replaced=False)

    small, large = plan(list(range(8))), plan(list(range(4096)))
    assert len(large.to_json()) - len(small.to_json()) <= 6  # the digits of 4096 against 8, twice
    shrunk = plan([slot for slot in range(4096) if slot not in (5, 4095, 17)])  # three shrinks
    assert len(shrunk.to_json()) < len(small.to_json()) + 20
    for one in (small, large, shrunk, Plan(**{**small.__dict__, "ranks": {2: 1, 0: 0}})):
        assert Plan.from_json(one.to_json()) == one
    odd = Plan(**{**small.__dict__, "ranks": {0: 1, 1: 0}})  # not in slot order: written whole
    assert Plan.from_json(odd.to_json()) == odd


def test_a_beat_is_two_requests_before_and_after_a_plan_and_reads_the_newest_generation():
    from ddp_hpc.bench.store_calls import CountingStore
    from ddp_hpc.engine.recovery.store import LaunchStore, Plan, beat, connect

    launch = LaunchStore()
    rank = CountingStore(connect(launch.address, 30))
    assert beat(rank, 3) == 0 and rank.calls == 2
    launch.publish(Plan(generation=1, world_size=4, ranks={s: s for s in range(4)}, lost=1, host="h", cause="c",
                        detected_at=0.0, replaced=True))
    assert beat(rank, 3) == 1 and rank.calls == 4
    assert launch.beats(3) == 2


def test_the_launch_asks_whether_every_rank_is_ready_in_batches_and_names_the_missing():
    from ddp_hpc.bench.store_calls import CountingStore
    from ddp_hpc.engine.recovery.store import LaunchStore, ready_key

    launch = LaunchStore()
    slots = range(1000)
    launch.store.multi_set([ready_key(slot) for slot in slots if slot != 700], ["1"] * 999)
    launch.store = CountingStore(launch.store)
    assert launch.not_ready(slots) == [700]
    assert launch.store.calls == 4 + 256  # one request a batch of 256, then one a slot of the batch missing one
    launch.store.calls = 0
    assert not launch.all_ready(slots) and launch.store.calls == 3  # stops at the batch with a gap
    launch.store.store.set(ready_key(700), "1")
    launch.store.calls = 0
    assert launch.all_ready(slots) and launch.not_ready(slots) == [] and launch.store.calls == 8

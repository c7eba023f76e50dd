"""One heartbeat per rank (ddp_hpc.engine.liveness), whoever reads it: under in-job recovery
the launch's hang detector (``LaunchStore.beats_of``) and the rank's watchdog (its
diagnosis of who went silent) read the same counters, kept by one thread per rank.
In-process, against a real launch store."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist


def heartbeat_threads() -> int:
    return sum(thread.name == "ddp-hpc-heartbeat" for thread in threading.enumerate())


def test_one_heartbeat_serves_the_launchs_hang_detector_and_the_watchdogs_diagnosis():
    from ddp_hpc.engine import liveness
    from ddp_hpc.engine.recovery import store as keys
    from ddp_hpc.engine.watchdog import watchdog

    launch = keys.LaunchStore()
    slots = (0, 1, 2)
    host, _, port = launch.address.rpartition(":")
    # Slots 1 and 2 stand for the other ranks' processes; slot 0 is this process's rank, its
    # heartbeat built as InJobRecovery builds it.
    peers = [liveness.Heartbeat(slot, 3, f"host{slot}", host, int(port), interval_s=0.05, keys=keys.BEAT_KEYS)
             for slot in (1, 2)]
    beaten: list[int] = []
    own = keys.heartbeat(launch.address, 0, lambda: slots, lambda store: beaten.append(keys.latest(store)), 0.05, 5.0)
    for beat in peers:
        beat.start()
    own.start()
    try:
        deadline = time.monotonic() + 10
        while min(launch.beats_of(slots).values()) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(launch.beats_of(slots).values()) > 0, "a rank's heartbeat never reached the launch's store"
        assert beaten and beaten[-1] == 0  # the owner's listener ran on the beat (no plan yet)
        threads = heartbeat_threads()
        with watchdog(60, heartbeat=own) as dog:
            # The watchdog reports through the running heartbeat: no thread of its own.
            assert heartbeat_threads() == threads
            assert dog.diagnose is not None, "the watchdog does not report through the running heartbeat"
            peers[1].stop(timeout_s=5)  # slot 2 goes silent
            before = launch.beats_of(slots)
            diagnosis = dog.diagnose()  # what the watchdog logs when it fires (it watches 2.5 s)
            after = launch.beats_of(slots)
            assert launch.store.check([keys.BEAT_KEYS.status(0)])  # its status went with the same beats
        assert [slot for slot in slots if after[slot] == before[slot]] == [2]  # the launch's view
        assert diagnosis.startswith("silent: rank 2 on host host2 (no heartbeat for 2s, while the launch's store at "
                                    f"{launch.address} still answers this rank)"), diagnosis
        assert own.status is None and own._thread.is_alive()  # the watchdog left it beating
    finally:
        own.stop(timeout_s=5)
        for beat in peers:
            beat.stop(timeout_s=5)


def test_the_recoverys_heartbeat_is_the_watchdogs_and_still_breaks_a_group_older_than_the_newest_plan(
        monkeypatch):
    from ddp_hpc.contract import RECOVERY_STORE_VAR
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.recovery import store as keys
    from ddp_hpc.engine.watchdog import watchdog

    launch = keys.LaunchStore()
    broken: list[int | None] = []
    monkeypatch.setattr(InJobRecovery, "_break_group", lambda self, older_than=None: broken.append(older_than))
    threads = heartbeat_threads()
    recovery = InJobRecovery("gloo", environ={"RANK": "0", "WORLD_SIZE": "1", RECOVERY_STORE_VAR: launch.address},
                             heartbeat_s=0.05)
    try:
        assert heartbeat_threads() == threads + 1 and recovery.heartbeat is not None
        with watchdog(60, heartbeat=recovery.heartbeat) as dog:
            assert heartbeat_threads() == threads + 1  # a rank running both runs one heartbeat
            first = launch.beats_of([0])[0]
            assert "every rank's heartbeat still moves" in dog.diagnose()
            assert launch.beats_of([0])[0] > first  # the counter the launch's hang detector reads
        assert not broken
        launch.publish(keys.Plan(generation=1, world_size=1, ranks={0: 0}, lost=1, host="h", cause="c",
                                 detected_at=0.0, replaced=True))
        deadline = time.monotonic() + 10
        while not broken and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broken and broken[0] == 1  # a newer plan seen on a beat: the older group is left
    finally:
        recovery.close()
    assert heartbeat_threads() == threads
    assert not dist.is_initialized()


def test_in_job_recovery_built_with_start_false_does_nothing_until_it_is_started():
    """``InJobRecovery(..., start=False)`` reads its settings only: no group, no store
    connection, no heartbeat; ``start()`` forms the group and starts the heartbeat, once."""
    from ddp_hpc.contract import RECOVERY_STORE_VAR
    from ddp_hpc.engine.recovery import InJobRecovery
    from ddp_hpc.engine.recovery import store as keys

    launch = keys.LaunchStore()
    threads = heartbeat_threads()
    recovery = InJobRecovery("gloo", environ={"RANK": "0", "WORLD_SIZE": "1", RECOVERY_STORE_VAR: launch.address},
                             heartbeat_s=0.05, start=False)
    try:
        assert recovery.enabled and recovery.slot == 0 and recovery.heartbeat is None
        assert not dist.is_initialized() and heartbeat_threads() == threads
        assert recovery.start() is recovery
        assert dist.is_initialized() and heartbeat_threads() == threads + 1
        heartbeat = recovery.heartbeat
        assert recovery.start() is recovery and recovery.heartbeat is heartbeat  # once per object
        assert heartbeat_threads() == threads + 1
    finally:
        recovery.close()
    assert not dist.is_initialized() and heartbeat_threads() == threads


def test_a_start_that_failed_raises_again_and_close_leaves_a_group_it_did_not_form():
    """A start that could not reach the launch's store raises the same error on the next
    ``start()`` (``run`` cannot go on without a group); ``close()`` of an object never
    started ends no process group of someone else's."""
    import socket

    from ddp_hpc.contract import RECOVERY_STORE_VAR, RECOVERY_WAIT_VAR
    from ddp_hpc.engine.recovery import InJobRecovery

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{unused.getsockname()[1]}"
    environ = {"RANK": "0", "WORLD_SIZE": "1", RECOVERY_STORE_VAR: nobody, RECOVERY_WAIT_VAR: "1"}
    recovery = InJobRecovery("gloo", environ=environ, start=False)
    with pytest.raises(Exception) as first:
        recovery.start()
    with pytest.raises(Exception) as again:
        recovery.start()
    assert again.value is first.value and not dist.is_initialized()

    never_started = InJobRecovery("gloo", environ={"RANK": "0", "WORLD_SIZE": "1"}, start=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        never_started.close()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()

"""Who is out of step in the collectives, and who is a straggler: the reports' logic, and
the heartbeats that carry what they compare (the launches are in test_reliability.py)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from contextlib import ExitStack
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddp_hpc.engine.collectives import CollectivePosition, entry_position, out_of_step
from ddp_hpc.engine import liveness
from ddp_hpc.engine import watchdog as watchdog_module
from ddp_hpc.engine.liveness import Heartbeat, RankStatus, find_stragglers
from ddp_hpc.environment.ports import free_port

HOSTS = {0: "h1", 1: "h1", 2: "h2", 3: "h2"}
AR = CollectivePosition(813, "all_reduce", 4 << 20, done=False)


def test_the_rank_behind_is_named_with_its_collective_and_the_others():
    behind = CollectivePosition(812, "all_reduce", 4 << 20, done=False)
    assert out_of_step({0: AR, 1: AR, 2: AR, 3: behind}, HOSTS) == (
        "out of step: rank 3 (host h2) is at collective #812 (all_reduce, 4.0 MiB); "
        "every other rank is at collective #813 (all_reduce, 4.0 MiB)")


def test_a_rank_in_its_own_code_after_a_collective_is_named_past_it():
    done = CollectivePosition(812, "all_reduce", 4 << 20, done=True)
    assert out_of_step({0: AR, 1: done}, HOSTS).startswith(
        "out of step: rank 1 (host h1) is past collective #812 (all_reduce, 4.0 MiB); every other rank is at "
        "collective #813")


def test_a_different_op_at_the_same_number_is_named_and_ranks_without_a_record_are_listed():
    barrier = CollectivePosition(813, "barrier", 0, done=False)
    assert out_of_step({0: AR, 1: barrier, 2: AR, 3: None}, HOSTS) == (
        "out of step: rank 1 (host h1) is at collective #813 (barrier); every other rank is at collective #813 "
        "(all_reduce, 4.0 MiB) (no flight record from rank 3 (host h2))")


def test_ranks_in_step_are_said_to_be_so_and_no_record_says_how_to_get_one():
    assert out_of_step({0: AR, 1: AR}, HOSTS) == \
        "every rank is at collective #813 (all_reduce, 4.0 MiB): none is out of step"
    assert "set TORCH_FR_BUFFER_SIZE=16 before the process group starts" in out_of_step({0: None, 1: None}, HOSTS)


def test_a_flight_recorder_entry_gives_op_bytes_and_state():
    entry = {"collective_seq_id": 6, "profiling_name": "gloo:all_reduce", "input_sizes": [[1024], [2, 3]],
             "input_dtypes": ["Float", "BFloat16"], "retired": False, "record_id": 5}
    assert entry_position(entry) == CollectivePosition(6, "all_reduce", 1024 * 4 + 6 * 2, done=False)
    assert CollectivePosition.from_text(entry_position(entry).to_text()) == entry_position(entry)


def test_stragglers_are_compared_with_the_median_of_the_others():
    # Of two ranks, one 3x slower is named (against the median of both it would be 1.5x).
    assert [(rank, round(ratio, 2)) for rank, ratio, _ in find_stragglers({0: 0.1, 1: 0.3})] == [(1, 3.0)]
    assert find_stragglers({0: 0.1, 1: 0.12, 2: 0.15, 3: 0.11}) == []


def test_rank_zeros_heartbeat_names_a_straggler_with_its_host_and_ratio_and_nobody_else():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    step_s = {0: 0.10, 1: 0.11, 2: 0.35}
    found = []
    beats = [Heartbeat(rank, 3, f"host{rank}", "127.0.0.1", port, interval_s=0.1,
                       status=lambda rank=rank: RankStatus(None, step_s[rank], 40),
                       on_straggler=found.append if rank == 0 else None) for rank in range(3)]
    with ExitStack() as stack:
        # Ranks 1 and 2 publish first, so that rank 0's first check sees every rank: a check
        # that saw rank 2 but not yet rank 1 (under load) names it against rank 0 alone.
        for beat in beats[1:]:
            stack.enter_context(beat)
        server.wait([liveness.RENDEZVOUS_KEYS.status(rank) for rank in (1, 2)], timedelta(seconds=10))
        stack.enter_context(beats[0])
        deadline = time.monotonic() + 5
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
    del server
    assert found, "rank 0 named no straggler"
    assert (found[0].rank, found[0].host, found[0].step) == (2, "host2", 40)
    assert abs(found[0].ratio - 0.35 / 0.105) < 0.01
    assert set(beats[0].stragglers) == {2} and not beats[1].stragglers  # only rank 0 checks


def _wait_for_collective_of(store: dist.TCPStore, rank: int, within_s: float = 30) -> None:
    key = liveness.RENDEZVOUS_KEYS.status(rank)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if store.check([key]) and RankStatus.from_text(store.get(key).decode()).collective is not None:
            return
        time.sleep(0.05)
    raise AssertionError(f"rank {rank}'s heartbeat published no collective within {within_s:g} s")


def test_a_collective_timeout_inside_the_watchdog_logs_who_is_out_of_step(monkeypatch, caplog):
    """The process group's own timeout (a RuntimeError from the collective) passes through
    the watchdog's block: rank 0 logs the collectives line, then the error goes on."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    behind = CollectivePosition(812, "all_reduce", 4 << 20, done=False)
    peer = Heartbeat(1, 2, "host1", "127.0.0.1", port, interval_s=0.1, status=lambda: RankStatus(behind, None, 3))
    monkeypatch.setattr(watchdog_module, "position", lambda: AR)  # rank 0 (this process) waits at #813
    with peer, caplog.at_level(logging.ERROR, logger="ddp_hpc.engine.watchdog"):
        with pytest.raises(RuntimeError, match="Timed out waiting"):
            with watchdog_module._watching(10, 0, 2, ("127.0.0.1", port)):
                _wait_for_collective_of(server, 1)
                _wait_for_collective_of(server, 0)  # idle for over a beat: rank 0's heartbeat publishes it
                raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600000ms for recv")
    del server
    assert ("a collective timed out; collectives: out of step: rank 1 (host host1) is at collective #812 "
            "(all_reduce, 4.0 MiB); every other rank is at collective #813 (all_reduce, 4.0 MiB)") in caplog.text


def test_the_flight_recorder_is_read_only_once_a_rank_makes_no_progress(monkeypatch):
    monkeypatch.setattr(watchdog_module, "position", lambda: AR)
    dog = watchdog_module.Watchdog(30, 0)
    dog.beat(compute_s=0.1)
    assert watchdog_module.rank_status(dog, interval_s=5).collective is None  # beating: no dump
    assert watchdog_module.rank_status(dog, interval_s=0).collective == AR


@pytest.mark.parametrize("logging_setup, in_file", [
    ("", False),                                              # nothing configured
    ("logging.basicConfig()", False),                         # a console log: on stderr once, not twice
    ("logging.basicConfig(filename=sys.argv[1])", True),      # a log file gets it too
    ("logging.basicConfig(handlers=[logging.StreamHandler(), logging.FileHandler(sys.argv[1])])", True),  # both
])
def test_a_watchdog_line_reaches_stderr_once_and_a_log_file_too(logging_setup, in_file, tmp_path):
    log_file = tmp_path / "job.log"
    code = (f"import logging, sys\n{logging_setup}\n"
            "from ddp_hpc.engine.watchdog import _say\n_say('[rank 3] watchdog: no progress for 9s')\n")
    result = subprocess.run([sys.executable, "-c", code, str(log_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.count("[rank 3] watchdog: no progress for 9s") == 1, result.stderr
    assert (log_file.exists() and "[rank 3] watchdog: no progress" in log_file.read_text()) == in_file

"""The process-group context and its collectives, in real gloo groups of one and two ranks."""

from __future__ import annotations

import gc
import multiprocessing
import queue
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.startup.distributed import DistributedOptions, bind_listener, end_process_group, process_group
from ddp_hpc.environment.ports import free_port
from ddp_hpc.startup.doctor import RankReport, check_all_reduce, check_parameter_sync, find_problems, format_table
from ddp_hpc.errors import UserError


def test_one_rank_group_is_created_used_and_destroyed():
    options = DistributedOptions(init_single_process=True, timeout_s=30)
    with process_group(options, environ={}) as ctx:
        assert dist.is_initialized() and ctx.group_initialized and ctx.world_size == 1
        assert ctx.all_reduce([1.0, 2.5]) == [1.0, 2.5]  # identities on one rank: the two-rank test checks values
        assert check_all_reduce(ctx) is None
        assert check_parameter_sync(ctx) is None
    assert not dist.is_initialized()


def _two_rank_worker(rank: int, port: int, folder: str, results) -> None:
    environ = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    marker = Path(folder) / "written-by-rank-0"
    seen: dict = {}
    # A short collective timeout: a rank left waiting in a barrier fails in seconds, not minutes.
    with process_group(DistributedOptions(device="cpu", backend="gloo", timeout_s=20), environ=environ) as ctx:
        seen["world_size"] = ctx.world_size
        seen["sum"] = ctx.all_reduce([rank + 1.0, 10.0 * rank])
        seen["mean"] = ctx.all_reduce([rank + 1.0], op="mean")
        seen["max"] = ctx.all_reduce([float(rank)], op="max")
        seen["min"] = ctx.all_reduce([float(rank)], op="min")
        seen["broadcast"] = ctx.broadcast_object({"from": rank})
        seen["broadcast_from_1"] = ctx.broadcast_object(rank * 7, src=1)
        seen["all_gather"] = ctx.all_gather_object(f"r{rank}")
        seen["gather"] = ctx.gather_object(rank * 3)
        seen["doctor_all_reduce"] = check_all_reduce(ctx)
        seen["doctor_parameter_sync"] = check_parameter_sync(ctx)
        with ctx.rank_zero_first():
            if rank == 0:
                time.sleep(0.5)  # rank 1, if it did not wait, would look before the file exists
                marker.write_text("0")
            else:
                seen["marker_on_entry"] = marker.exists()
        results.put((rank, seen))  # before the group's teardown, which a stuck peer would hold up


def test_collectives_and_rank_zero_first_on_two_real_ranks(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_two_rank_worker, args=(rank, port, str(tmp_path), results))
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + 120
    try:
        while len(seen) < 2 and time.monotonic() < deadline:
            try:
                rank, facts = results.get(timeout=1)
                seen[rank] = facts
            except queue.Empty:
                if any(process.exitcode not in (None, 0) for process in ranks):
                    break  # a rank failed: what the others saw says why
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert 1 in seen, "rank 1 never finished"
    assert seen[1]["marker_on_entry"], "rank 1 entered rank_zero_first's block before rank 0 had finished it"
    assert [process.exitcode for process in ranks] == [0, 0]
    for rank in (0, 1):
        assert seen[rank]["world_size"] == 2
        assert seen[rank]["sum"] == [3.0, 10.0]
        assert seen[rank]["mean"] == [1.5]
        assert seen[rank]["max"] == [1.0] and seen[rank]["min"] == [0.0]
        assert seen[rank]["broadcast"] == {"from": 0}
        assert seen[rank]["broadcast_from_1"] == 7
        assert seen[rank]["all_gather"] == ["r0", "r1"]
        assert seen[rank]["doctor_all_reduce"] is None and seen[rank]["doctor_parameter_sync"] is None
    assert seen[0]["gather"] == [0, 3] and seen[1]["gather"] is None


def test_group_is_destroyed_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with process_group(DistributedOptions(init_single_process=True), environ={}):
            raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_end_process_group_frees_a_ddp_in_a_cycle_before_destroying_and_then_does_nothing(monkeypatch):
    destroyed_after_ddp_freed = []
    destroy = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):
        destroyed_after_ddp_freed.append(ddp() is None)
        return destroy(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    gc.disable()  # only end_process_group's own gc.collect() may free the cycle
    try:
        with process_group(DistributedOptions(init_single_process=True, timeout_s=30), environ={}):
            model = DistributedDataParallel(torch.nn.Linear(2, 2))
            model.cycle = model
            ddp = weakref.ref(model)
            del model
            end_process_group()
            assert not dist.is_initialized() and destroyed_after_ddp_freed == [True]
            end_process_group()
    finally:
        gc.enable()
    assert destroyed_after_ddp_freed == [True]  # process_group's exit found nothing left to end


def test_one_process_needs_no_group():
    with process_group(environ={}) as ctx:
        assert not ctx.group_initialized and not dist.is_initialized()
        assert ctx.all_reduce([3.0], op="max") == [3.0]
        assert ctx.broadcast_object({"a": 1}) == {"a": 1}
        assert ctx.all_gather_object("x") == ["x"] and ctx.gather_object("y") == ["y"]
        entered = []
        with ctx.rank_zero_first():  # no group to wait on: the body runs at once
            entered.append(True)
        assert entered == [True]


def test_bad_choice_fails_before_any_group():
    with pytest.raises(UserError, match="nccl"):
        with process_group(DistributedOptions(backend="nccl", device="cpu"), environ={}):
            pass
    assert not dist.is_initialized()


def test_timeout_must_be_positive():
    with pytest.raises(UserError, match="timeout_s"):
        DistributedOptions(timeout_s=0)


def test_rendezvous_listener_binds_the_master_address_only():
    listener = bind_listener("127.0.0.1", 0)
    try:
        host, port = listener.getsockname()
        assert host == "127.0.0.1" and port > 0
        listener.listen()  # the port is now taken by a running rendezvous
        with pytest.raises(UserError, match=f"rendezvous port {port} on 127.0.0.1 is already in use"):
            bind_listener("127.0.0.1", port)
    finally:
        listener.close()


def test_a_master_address_of_another_host_is_refused_on_rank_0():
    # TEST-NET-1: never a local address. The other ranks would wait there for ever.
    with pytest.raises(UserError, match="master address 192.0.2.1 is not an address of rank 0's host"):
        bind_listener("192.0.2.1", 0)


def test_unresolvable_master_address_is_named():
    with pytest.raises(UserError, match="master address 'no-such-host.invalid' does not resolve"):
        bind_listener("no-such-host.invalid", 1234)


def _report(rank, host="h0", local_rank=None, node_rank=0, world_size=2, local_world_size=2,
            device="cpu", backend="gloo"):
    return RankReport(rank, world_size, node_rank, host, rank if local_rank is None else local_rank,
                      local_world_size, device, backend, "slurm", "2.13.0", 100 + rank)


def test_doctor_finds_no_problem_in_a_healthy_job():
    reports = [_report(0), _report(1)]
    assert find_problems(reports) == []
    assert "world_size" in format_table(reports).splitlines()[0]


@pytest.mark.multiproc
def test_doctor_exits_non_zero_when_two_real_ranks_disagree():
    """Two ``ddp-hpc doctor`` processes that really disagree (README: doctor exits non-zero
    if two ranks disagree): rank 1 says it is alone on node 0 (LOCAL_WORLD_SIZE=1, LOCAL_RANK=0),
    rank 0 that node 0 has 2 ranks. Both exit 1; rank 0 prints each disagreement."""
    import subprocess

    from conftest import clean_env, ddp_hpc_command

    port = str(free_port())
    ranks = [subprocess.Popen([*ddp_hpc_command(), "doctor", "--timeout", "60"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=clean_env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                             "LOCAL_WORLD_SIZE": str(2 - rank), "GROUP_RANK": "0",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
             for rank in range(2)]
    (out, err), _ = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [1, 1], err
    assert "doctor: FAILED: node rank 0 has 2 ranks but they report local world sizes [1, 2]" in out, out + err
    assert "doctor: FAILED: node rank 0 has local ranks [0, 0], expected 0..1" in out, out + err
    assert "doctor: OK" not in out


@pytest.mark.parametrize("reports,fragment", [
    ([_report(0), _report(0, local_rank=1)], "ranks are [0, 0]"),
    ([_report(0), _report(1, world_size=3)], "world sizes [2, 3]"),
    ([_report(0), _report(1, backend="nccl")], "disagree on backend"),
    ([_report(0), _report(1, host="h1")], "spans hosts"),
    ([_report(0), _report(1, local_rank=0)], "local ranks [0, 0]"),
    ([_report(0, device="cuda:0"), _report(1, device="cuda:0")], "share device ['cuda:0']"),
    ([_report(0, local_world_size=1), _report(1)], "report local world sizes [1, 2]"),
])
def test_doctor_reports_each_disagreement(reports, fragment):
    assert any(fragment in problem for problem in find_problems(reports))

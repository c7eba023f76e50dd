"""The rendezvous handshake and the launcher abort, in one process: what each failure says."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddp_hpc.startup import fail_fast
from ddp_hpc.bench.store_calls import CountingStore
from ddp_hpc.contract import ExitStatus
from ddp_hpc.startup.distributed import DistributedOptions, create_store, process_group
from ddp_hpc.environment import resolve_env
from ddp_hpc.environment.ports import free_port
from ddp_hpc.errors import UserError
from ddp_hpc.startup.rendezvous import (ABANDON_AFTER_S, JOINED_KEY, MARKER_KEY, Absent, RendezvousError,
                                        _missing_ranks, absent_ranks, parse_timeout, rank_ranges)
from launch_records import MPICH_RANK1, OPENMPI_RANK1, SRUN_RANK3, TORCHRUN_RANK1

pytestmark = pytest.mark.reliability
HOST = socket.gethostname()


def rank_env(rank: int, world_size: int, port: int, timeout: str = "2") -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DDP_HPC_RENDEZVOUS_TIMEOUT": timeout}


def join(env: dict[str, str]) -> None:
    with process_group(DistributedOptions(device="cpu", backend="gloo"), environ=env):
        pass


def timed_join(env: dict[str, str]) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        join(env)
    return str(caught.value), time.monotonic() - started


#: The 2 s rendezvous timeout, the bounded join's own margin past it, room for a loaded machine.
BOUND_S = 2 + ABANDON_AFTER_S + 5


def test_a_foreign_listener_is_named_within_the_timeout():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        message, seconds = timed_join(rank_env(1, 2, port))
    # torch's own client would wait here for ever (it expects an answer that never comes).
    assert message == (f"rank 1 on host {HOST}: the listener at 127.0.0.1:{port} did not answer as a rendezvous "
                       "store within 2s (distributed.rendezvous_timeout_s): another program holds the port; set "
                       "MASTER_PORT to a free port")
    assert seconds < BOUND_S


def test_nothing_listening_is_named_within_the_timeout():
    port = free_port()
    message, seconds = timed_join(rank_env(1, 2, port))
    assert message.startswith(f"rank 1 on host {HOST}: no rendezvous store answered at 127.0.0.1:{port} within 2s")
    assert seconds < BOUND_S


def test_another_jobs_store_is_recognised():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store.set(MARKER_KEY, "world_size=2 launcher=slurm SLURM_JOB_ID=41")
    with pytest.raises(RendezvousError) as caught:
        join({**rank_env(1, 2, port), "SLURM_JOB_ID": "42"})
    assert str(caught.value) == (
        f"rank 1 on host {HOST}: the rendezvous store at 127.0.0.1:{port} belongs to another job (world_size=2 "
        "launcher=slurm SLURM_JOB_ID=41), not this one (world_size=2 launcher=env SLURM_JOB_ID=42): set MASTER_PORT "
        "to a free port")
    del store


def test_rank_0_names_the_ranks_that_never_joined_as_runs_with_their_hosts():
    # 12 ranks, 4 a node. Rank 0 (here) and rank 5 (a client writing its joined key as host
    # c2) join. Node 0's host is the one rank 0 wrote, node 1's the one rank 5 wrote; no rank
    # of node 2 joined, so its host comes from the job's node list.
    port = free_port()
    env = {**rank_env(0, 12, port), "LOCAL_WORLD_SIZE": "4", "SLURM_JOB_NODELIST": f"{HOST},c2,c3"}

    joined: list[str] = []

    def rank5() -> None:
        # Connect only once rank 0's store listens: a refused first connect backs off for
        # about a second in torch's client, which a loaded machine can push past the 2 s.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.01)
        store = dist.TCPStore("127.0.0.1", port, 12, is_master=False, timeout=timedelta(seconds=10))
        store.set("ddp_hpc/joined/5", "c2")
        store.add("ddp_hpc/joined", 1)
        joined.append("c2")

    thread = threading.Thread(target=rank5)
    thread.start()
    message, seconds = timed_join(env)
    thread.join(10)
    assert joined == ["c2"], "rank 5 never wrote its joined key"
    assert message == (f"rank 0 on host {HOST}: ranks 1-4, 6-11 (10 of 12) did not join the rendezvous at "
                       f"127.0.0.1:{port} within 2s (distributed.rendezvous_timeout_s); they were to run on {HOST} "
                       "(ranks 1-3), c2 (ranks 4, 6-7), c3 (ranks 8-11, from the node list): see their logs for why")
    assert seconds < BOUND_S


def test_a_node_list_that_disagrees_with_the_joined_hosts_names_no_host():
    """After a restart left a node out (or with ranks round-robin), the list's order is not
    the ranks': node 1's joined rank says c3 where the list says c2, so the list is not used."""
    store = dist.HashStore()
    for rank, host in ((0, HOST), (4, "c3")):
        store.set(f"{JOINED_KEY}/{rank}", host)
    store.add(JOINED_KEY, 2)
    env = resolve_env({**rank_env(0, 12, 1), "LOCAL_WORLD_SIZE": "4"})
    absent = absent_ranks(store, env, (HOST, "c2", "c3"))
    assert absent == Absent("ranks 1-3, 5-11 (10 of 12)",
                            f"{HOST} (ranks 1-3), c3 (ranks 5-7); host unknown for node(s) 2")
    assert absent_ranks(store, env, (HOST, "c3", "c2")) == Absent(
        "ranks 1-3, 5-11 (10 of 12)", f"{HOST} (ranks 1-3), c3 (ranks 5-7), c2 (ranks 8-11, from the node list)")


@pytest.mark.parametrize("missing", [[], [3, 4, 5, 6, 7, 2048, 4095], list(range(1, 4096, 2))],
                         ids=["none", "few", "every-other"])
def test_missing_ranks_cost_few_round_trips_when_few_are_missing(missing):
    world = 4096
    store = CountingStore(dist.HashStore())
    for rank in sorted(set(range(world)) - set(missing)):
        store.store.set(f"{JOINED_KEY}/{rank}", "h")
    store.store.add(JOINED_KEY, world - len(missing))
    assert _missing_ranks(store, world) == missing
    # Today's one check a rank is the ceiling; 7 missing of 4096 take well under 1 %.
    assert store.calls <= (world + 1 if len(missing) > 100 else 20 * len(missing) + 1), store.calls


def test_rank_runs_are_compact_and_capped():
    assert rank_ranges([12, 3, 4, 5, 6, 7]) == "3-7, 12"
    assert rank_ranges(list(range(0, 4096, 2))) == ", ".join(str(r) for r in range(0, 32, 2)) + " and 2032 more"


def test_ranks_that_all_arrive_meet():
    port = free_port()
    errors: list[BaseException] = []

    def rank1() -> None:  # the second rank, as a thread
        try:
            env = rank_env(1, 2, port, "20")
            create_store(resolve_env(env), timedelta(seconds=20), env, 20)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=rank1)
    thread.start()
    env0 = rank_env(0, 2, port, "20")
    store = create_store(resolve_env(env0), timedelta(seconds=20), env0, 20)
    thread.join(30)
    assert not errors, errors
    assert store.get("ddp_hpc/joined/1").decode() == HOST and store.add("ddp_hpc/joined", 0) == 2


@pytest.mark.parametrize("version,libuv", [("2.5.1", False), ("2.7.1+cu126", False), ("2.8.0", True),
                                           ("2.14.1", True)])
def test_rank_0_serves_its_bound_socket_with_the_store_server_that_torch_version_can_take(monkeypatch, version,
                                                                                          libuv):
    """Before torch 2.8 the libuv server refuses the socket rank 0 binds, so the legacy one serves it."""
    monkeypatch.setattr("ddp_hpc.startup.distributed.installed", lambda: version)
    env = rank_env(0, 1, free_port(), "20")
    store = create_store(resolve_env(env), timedelta(seconds=20), env, 20)
    assert store.libuvBackend is libuv
    assert store.get("ddp_hpc/joined/0").decode() == HOST


@pytest.mark.parametrize("raw,expected", [(None, 180.0), ("", 180.0), ("45", 45.0), ("0.5", 0.5)])
def test_rendezvous_timeout_from_the_environment(raw, expected):
    assert parse_timeout(raw, 180.0) == expected


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "nan"])
def test_a_bad_rendezvous_timeout_is_named(raw):
    with pytest.raises(UserError, match="DDP_HPC_RENDEZVOUS_TIMEOUT="):
        parse_timeout(raw, 180.0)


def test_the_rendezvous_timeout_must_be_positive():
    with pytest.raises(UserError, match="rendezvous_timeout_s"):
        DistributedOptions(rendezvous_timeout_s=0)


# ----- ending the job through the launcher --------------------------------------------


def test_hydra_gets_a_pmi_abort_with_the_exit_code(monkeypatch):
    monkeypatch.setattr(fail_fast, "OUTPUT_GRACE_S", 0)
    read, write = os.pipe()
    try:
        done = fail_fast.end_job(2, {**MPICH_RANK1, "PMI_FD": str(write)})
        assert done == "PMI abort with exit code 2"
        assert os.read(read, 100) == b"cmd=abort exitcode=2\n"  # what MPI_Abort sends (PMI-1 wire protocol)
    finally:
        os.close(read)
        os.close(write)


def test_the_job_is_ended_only_once_the_launcher_has_read_the_rank_s_last_output(monkeypatch):
    """The error line waits in the pipe to Hydra's proxy; a loaded proxy reads it 0.8 s later:
    the abort goes after that read, not after the fixed grace (Hydra drops unread output)."""
    monkeypatch.setattr(fail_fast, "OUTPUT_GRACE_S", 0)
    output_read, output = os.pipe()
    pmi_read, pmi = os.pipe()
    read_at: list[float] = []

    def proxy() -> None:
        time.sleep(0.8)
        read_at.append(time.monotonic())
        os.read(output_read, 100)

    wait_until_output_read = fail_fast.wait_until_output_read  # as end_job calls it, on this pipe
    monkeypatch.setattr(fail_fast, "wait_until_output_read", lambda: wait_until_output_read(fds=[output]))
    try:
        os.write(output, b"ddp-hpc: error: rank 1 on host n1: ...\n")
        reader = threading.Thread(target=proxy)
        reader.start()
        fail_fast.end_job(2, {**MPICH_RANK1, "PMI_FD": str(pmi)})
        aborted_at = time.monotonic()
        reader.join(10)
        assert read_at and aborted_at >= read_at[0]
        assert os.read(pmi_read, 100) == b"cmd=abort exitcode=2\n"
    finally:
        for fd in (output_read, output, pmi_read, pmi):
            os.close(fd)


def test_output_nobody_reads_holds_the_job_for_a_bounded_time_only(tmp_path):
    output_read, output = os.pipe()
    try:
        os.write(output, b"never read")
        assert fail_fast.unread_bytes(output) == len(b"never read")
        started = time.monotonic()
        fail_fast.wait_until_output_read(0.3, fds=[output])
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        os.close(output_read)
        os.close(output)
    with open(tmp_path / "log", "w") as log_file:  # output to a file is read by nobody: no wait
        log_file.write("written")
        log_file.flush()
        assert fail_fast.unread_bytes(log_file.fileno()) == 0


@pytest.fixture
def srun_step(monkeypatch) -> tuple[dict[str, str], list[list[str]]]:
    """Task 3 of srun step 17.2, with scancel on PATH: (its environment, the commands run)."""
    monkeypatch.setattr(fail_fast, "OUTPUT_GRACE_S", 0)
    monkeypatch.setattr(fail_fast.shutil, "which", lambda name: f"/usr/bin/{name}")
    return {**SRUN_RANK3, "SLURM_JOB_ID": "17", "SLURM_STEP_ID": "2"}, []


def test_a_plain_srun_step_is_cancelled(srun_step):
    env, ran = srun_step
    assert fail_fast.end_job(1, env, run=ran.append) == "scancel --ctld --quiet --signal=KILL 17.2"
    assert ran == [["scancel", "--ctld", "--quiet", "--signal=KILL", "17.2"]]


@pytest.mark.parametrize("env", [TORCHRUN_RANK1, OPENMPI_RANK1, {}], ids=["torchrun", "openmpi", "single"])
def test_launchers_that_end_the_job_themselves_are_left_alone(env):
    assert fail_fast.abort_request(env) is None  # they kill the others on a non-zero exit


# Named here, not read from AGREED_EXIT_STATUSES: a status dropped from that set must fail this.
# The srun step would be cancelled for any other status (as above), so a wrongly ended job shows.
@pytest.mark.parametrize("code", [ExitStatus.OK, ExitStatus.REQUEUE])
def test_agreed_exits_end_nothing(code, srun_step):
    env, ran = srun_step
    assert fail_fast.end_job(code, env, run=ran.append) is None
    assert ran == []


def test_error_lines_name_the_rank_and_host_once():
    env = {**MPICH_RANK1}
    assert fail_fast.with_rank("port taken", env) == f"rank 1 on host {HOST}: port taken"
    assert fail_fast.with_rank(f"rank 1 on host {HOST}: x", env) == f"rank 1 on host {HOST}: x"
    assert fail_fast.with_rank("bad config", {}) == "bad config"


def test_rank_0_warns_when_ulimit_cannot_hold_two_store_connections_a_rank(monkeypatch):
    import resource

    from ddp_hpc.startup.distributed import descriptor_shortfall

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    assert descriptor_shortfall(300) is None  # 2 * 300 + 256 = 856 fit
    message = descriptor_shortfall(1000)
    assert message is not None and "may open only 1024 files (ulimit -n)" in message
    assert "raise it to at least 2256" in message

"""Network checks before the rendezvous (ddp_hpc.environment.netcheck) and the heartbeat that
names silent ranks (ddp_hpc.engine.liveness): pure checks over injected names and
interfaces, and a real local TCPStore. The same checks across real hosts are in
tests/test_multihost.py."""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddp_hpc.environment import DistEnv
from ddp_hpc.environment.netcheck import (GLOO_IFNAME_VAR, NetworkPlan, check_network, gloo_interface,
                                          local_interfaces, resolve_addresses)
from ddp_hpc.environment.ports import free_port
from ddp_hpc.errors import UserError
from ddp_hpc.engine.liveness import Heartbeat, describe_ranks, read_counters
from ddp_hpc.startup.rendezvous import KEYS_PER_REQUEST

NAMES = {"h1": ["198.18.14.11"], "h2": ["198.18.14.12"], "h1-hsn": ["198.18.15.11"],
         "h2-hsn": ["198.18.15.12"], "localhost": ["127.0.0.1"]}
INTERFACES = {"h1": {"lo": ("127.0.0.1",), "eth0": ("198.18.14.11",), "hsn0": ("198.18.15.11",)},
              "h2": {"lo": ("127.0.0.1",), "eth0": ("198.18.14.12",), "hsn0": ("198.18.15.12",)},
              "vm": {"lo": ("127.0.0.1",), "eth0": ("192.0.2.2",)}}


def env(rank: int = 2, master: str = "h1", num_nodes: int = 2) -> DistEnv:
    return DistEnv(rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2, node_rank=rank // 2,
                   num_nodes=num_nodes, master_addr=master, master_port=29500, source="slurm")


def check(dist_env: DistEnv, *, names=None, environ=None, suffix=None, backend="gloo", host="h2"):
    table = {**NAMES, **(names or {})}
    return check_network(dist_env, backend, host_suffix=suffix, environ=environ or {}, hostname=host,
                         resolve=lambda name: table.get(name, []), interfaces=INTERFACES[host])


def test_a_healthy_two_host_job_passes_and_leaves_gloo_its_choice():
    assert check(env()).gloo_ifname is None


def test_hostname_on_a_loopback_line_is_named_with_the_fix():
    with pytest.raises(UserError) as info:
        check(env(rank=2), names={"h2": ["127.0.1.1"]})
    message = str(info.value)
    assert "\n" not in message
    assert "rank 2 on host h2" in message and "127.0.1.1" in message
    assert "delete the line '127.0.1.1 h2' from /etc/hosts on h2" in message
    assert GLOO_IFNAME_VAR in message


def test_master_name_on_a_loopback_line_is_named_with_the_fix():
    # mpiexec inside a SLURM allocation: the node list shows that h2 is another machine.
    with pytest.raises(UserError, match=r"rank 0 on host h1: the rendezvous host 'h1' resolves to "
                                        r"127\.0\.1\.1.*delete the line '127\.0\.1\.1 h1' from "
                                        r"/etc/hosts on h1"):
        check(env(rank=0), names={"h1": ["127.0.1.1"]}, host="h1", environ={"SLURM_JOB_NODELIST": "h[1-2]"})
    # Without a host list, rank 0 cannot tell that the other nodes are elsewhere.
    assert check(env(rank=0), names={"h1": ["127.0.1.1"]}, host="h1") == NetworkPlan(
        reason="host name h1, all nodes on this machine")


def test_several_nodes_on_one_machine_may_use_loopback():
    """The shared test cluster: n1 and n2 are two slurmd on one machine, all on 127.0.0.1."""
    names = {"n1": ["127.0.0.1"], "n2": ["127.0.0.1"], "vm": ["127.0.0.1"]}
    slurm = {"SLURM_STEP_NODELIST": "n[1-2]"}
    for rank in range(4):
        assert check(env(rank=rank, master="n1"), names=names, host="vm", environ=slurm).gloo_ifname is None
        assert check(env(rank=rank, master="n1"), names=names, host="vm",
                     environ={**slurm, GLOO_IFNAME_VAR: "lo"}).gloo_ifname is None


def test_one_node_may_use_loopback():
    assert check(env(num_nodes=1, master="127.0.0.1"), names={"h2": ["127.0.1.1"]}) == NetworkPlan()


def test_nccl_needs_no_hostname_but_still_a_reachable_master():
    assert check(env(), names={"h2": ["127.0.1.1"]}, backend="nccl") == NetworkPlan()
    with pytest.raises(UserError, match="rendezvous host 'h1' resolves to 127.0.0.1"):
        check(env(rank=0), names={"h1": ["127.0.0.1"]}, backend="nccl", host="h1",
              environ={"SLURM_STEP_NODELIST": "h[1-2]"})


def test_unresolvable_hostname_is_refused():
    with pytest.raises(UserError, match="host name 'h2' does not resolve"):
        check(env(), names={"h2": []})


def test_host_suffix_picks_the_interface_of_the_suffixed_name():
    plan = check(env(), suffix="-hsn")
    assert plan.gloo_ifname == "hsn0" and "h2-hsn" in plan.reason
    # The suffix also comes from DDP_HPC_HOST_SUFFIX, as resolve_env reads it.
    assert check(env(), environ={"DDP_HPC_HOST_SUFFIX": "-hsn"}).gloo_ifname == "hsn0"


def test_host_suffix_that_names_no_local_address_is_refused():
    with pytest.raises(UserError, match=r"gives 'h2-ib', which does not resolve"):
        check(env(), suffix="-ib")
    with pytest.raises(UserError, match="not an address of this host"):
        check(env(), suffix="-hsn", names={"h2-hsn": ["198.18.15.99"]})


def test_gloo_socket_ifname_is_checked_against_the_hosts_interfaces():
    assert check(env(), environ={GLOO_IFNAME_VAR: "hsn0"}, suffix="-hsn").gloo_ifname is None
    with pytest.raises(UserError, match=r"GLOO_SOCKET_IFNAME=ib0 names interface 'ib0', which this host "
                                        r"does not have \(it has: eth0, hsn0, lo\)"):
        check(env(), environ={GLOO_IFNAME_VAR: "ib0"})
    with pytest.raises(UserError, match="is the loopback interface"):
        check(env(), environ={GLOO_IFNAME_VAR: "lo"})


def test_gloo_interface_is_set_only_while_the_group_starts(monkeypatch):
    monkeypatch.delenv(GLOO_IFNAME_VAR, raising=False)
    with gloo_interface(NetworkPlan(gloo_ifname="hsn0")):
        assert os.environ[GLOO_IFNAME_VAR] == "hsn0"
    assert GLOO_IFNAME_VAR not in os.environ
    monkeypatch.setenv(GLOO_IFNAME_VAR, "eth0")  # the user's own choice wins
    with gloo_interface(NetworkPlan(gloo_ifname="hsn0")):
        assert os.environ[GLOO_IFNAME_VAR] == "eth0"


def test_this_hosts_interfaces_and_names_are_read():
    assert "127.0.0.1" in local_interfaces().get("lo", ())
    assert "127.0.0.1" in resolve_addresses("localhost")
    assert resolve_addresses("no-such-host.invalid") == ()


def test_describe_ranks_groups_by_host():
    assert describe_ranks([2, 3, 5], {2: "h2", 3: "h2", 5: "h3"}) == \
        "ranks 2, 3 on host h2; rank 5 on host h3"


@contextmanager
def beating(ranks: int, world_size: int = 3):
    """A store served here and the heartbeats of ranks 0..ranks-1 of ``world_size``, beating."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    beats = [Heartbeat(rank, world_size, f"host{rank}", "127.0.0.1", port, interval_s=0.1)
             for rank in range(ranks)]
    with ExitStack() as stack:
        for beat in beats:
            stack.enter_context(beat)
        yield server, beats
    del server


def test_heartbeat_names_the_rank_that_stopped_and_finds_nobody_when_all_beat():
    with beating(3) as (_, beats):
        time.sleep(0.5)
        assert "every rank's heartbeat still moves" in beats[0].explain()
        beats[2].__exit__(None, None, None)  # rank 2 goes silent
        assert beats[0].explain().startswith("silent: rank 2 on host host2 (no heartbeat for 0s")


def test_heartbeat_names_a_rank_that_never_beat_through_the_per_key_reads():
    """Rank 2's counter does not exist, so the batched read cannot serve: the per-key path."""
    with beating(2) as (server, beats):
        time.sleep(0.5)
        assert not server.check(["ddp_hpc/heartbeat/2"])
        assert beats[0].explain().startswith("silent: rank 2 on host ? (no heartbeat")


def test_counters_are_read_in_store_sized_batches_and_a_missing_one_only_costs_its_batch():
    store = dist.HashStore()
    keys = [f"ddp_hpc/heartbeat/{rank}" for rank in range(600)]
    for rank, key in enumerate(keys):
        if rank != 500:
            store.add(key, rank)
    requests: list[int] = []

    class Recording:  # the store, recording how many keys each check asks about
        def check(self, batch: list[str]) -> bool:
            requests.append(len(batch))
            return store.check(batch)

        def __getattr__(self, name: str):
            return getattr(store, name)

    assert read_counters(Recording(), keys) == [rank if rank != 500 else 0 for rank in range(600)]
    assert requests == [KEYS_PER_REQUEST, KEYS_PER_REQUEST, 600 - 2 * KEYS_PER_REQUEST]
    assert store.check([keys[500]])  # created at 0 for the next read


def test_heartbeat_without_the_store_says_this_rank_is_cut_off():
    beat = Heartbeat(1, 2, "h2", "127.0.0.1", free_port(), interval_s=0.1, store_timeout_s=1)
    assert beat.explain().startswith("this rank cannot reach the rendezvous store at 127.0.0.1:")
    assert "host h2 has likely lost the job's network" in beat.explain()


def test_the_first_address_counts_when_a_name_has_a_loopback_and_a_real_line():
    with pytest.raises(UserError, match="the host name 'h2' resolves to 127.0.1.1"):
        check(env(), names={"h2": ["127.0.1.1", "198.18.14.12"]})
    assert check(env(), names={"h2": ["198.18.14.12", "127.0.1.1"]}).gloo_ifname is None


def test_an_unresolvable_rendezvous_host_is_refused_at_once():
    with pytest.raises(UserError, match="rank 2 on host h2: the rendezvous host 'h9' does not resolve here"):
        check(env(master="h9"))



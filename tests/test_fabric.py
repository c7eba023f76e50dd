"""Fabric variables checked before any rank waits (ddp_hpc.environment.fabric): the syntax
of each variable over injected interfaces, providers and libraries, and one real 2-rank
torchrun launch with ``GLOO_SOCKET_IFNAME=nope0`` (``ddp-hpc run`` and ``train`` with it: the
bad-input corpus)."""

from __future__ import annotations

import re
import time

import pytest

from conftest import run
from ddp_hpc.environment.fabric import (HostFabric, check_fabric, find_shared_library, interface_names,
                                        nccl_ifname_matches)
from ddp_hpc.errors import UserError

INTERFACES = ("lo", "eth0", "eth1", "hsn0", "docker0")
PROVIDERS = ("tcp", "udp", "shm", "ofi_rxm")


def host(libraries: frozenset[str] = frozenset(), providers=PROVIDERS) -> HostFabric:
    return HostFabric(interfaces=INTERFACES, providers=providers,
                      find_library=lambda name, environ: name in libraries)


def problem(backend: str, environ: dict[str, str], fabric: HostFabric | None = None) -> str | None:
    try:
        check_fabric(backend, environ, fabric or host(), where="rank 1 on host h2")
    except UserError as exc:
        return str(exc)
    return None


def test_gloo_interface_the_host_lacks_lists_what_it_has():
    message = problem("gloo", {"GLOO_SOCKET_IFNAME": "nope0"})
    assert message == ("rank 1 on host h2: GLOO_SOCKET_IFNAME=nope0 names interface 'nope0', which this host "
                       "does not have (it has: docker0, eth0, eth1, hsn0, lo)")
    # torch splits on commas and wants every name: one missing name is enough to fail.
    assert "'ib0'" in problem("nccl", {"GLOO_SOCKET_IFNAME": "eth0,ib0"})
    assert problem("gloo", {"GLOO_SOCKET_IFNAME": "eth0,hsn0"}) is None
    # gloo's names are exact, not prefixes.
    assert "'eth'" in problem("gloo", {"GLOO_SOCKET_IFNAME": "eth"})


def test_nccl_interface_syntax_follows_nccl():
    assert nccl_ifname_matches("eth", INTERFACES) == ["eth0", "eth1"]
    assert nccl_ifname_matches("=eth0", INTERFACES) == ["eth0"]
    assert nccl_ifname_matches("=eth", INTERFACES) == []
    assert nccl_ifname_matches("ib,hsn", INTERFACES) == ["hsn0"]
    assert nccl_ifname_matches("^docker,lo", INTERFACES) == ["eth0", "eth1", "hsn0"]
    assert nccl_ifname_matches("^=docker0", INTERFACES) == ["eth0", "eth1", "hsn0", "lo"]
    assert problem("nccl", {"NCCL_SOCKET_IFNAME": "hsn"}) is None
    assert problem("nccl", {"NCCL_SOCKET_IFNAME": "ib"}) == (
        "rank 1 on host h2: NCCL_SOCKET_IFNAME=ib matches no interface of this host "
        "(it has: docker0, eth0, eth1, hsn0, lo)")
    assert "leaves no interface" in problem("nccl", {"NCCL_SOCKET_IFNAME": "^e,l,h,d"})
    # Read only where NCCL runs: a gloo job is not stopped by a cluster-wide NCCL setting.
    assert problem("gloo", {"NCCL_SOCKET_IFNAME": "ib"}) is None


def test_ccl_interface_and_libfabric_provider():
    assert "CCL_KVS_IFACE=ib0 names interface 'ib0'" in problem("xccl", {"CCL_KVS_IFACE": "ib0"})
    assert problem("xccl", {"CCL_KVS_IFACE": "hsn0"}) is None
    assert problem("ccl", {"FI_PROVIDER": "cxi"}) == (
        "rank 1 on host h2: FI_PROVIDER=cxi names libfabric provider 'cxi', which this host does not have "
        "(it has: ofi_rxm, shm, tcp, udp)")
    assert problem("xccl", {"FI_PROVIDER": "tcp;ofi_rxm"}) is None
    assert problem("xccl", {"FI_PROVIDER": "^cxi"}) is None
    assert "excludes every libfabric provider" in problem("xccl", {"FI_PROVIDER": "^tcp,udp,shm,ofi_rxm"})
    # Without fi_info there is nothing to compare with: not checked rather than guessed.
    assert problem("xccl", {"FI_PROVIDER": "cxi"}, host(providers=None)) is None


def test_nccl_net_needs_its_plugin_library():
    assert problem("nccl", {"NCCL_NET": "IB"}) is None
    assert problem("nccl", {"NCCL_NET": "Socket"}) is None
    message = problem("nccl", {"NCCL_NET": "AWS Libfabric"})
    assert message == ("rank 1 on host h2: NCCL_NET=AWS Libfabric is not built into NCCL (IB, Socket) and needs "
                       "a network plugin, but its library libnccl-net.so is not found (searched LD_LIBRARY_PATH "
                       "and the linker cache): add its folder to LD_LIBRARY_PATH or fix NCCL_NET_PLUGIN")
    assert "libnccl-net-ofi.so is not found" in problem("nccl", {"NCCL_NET": "OFI", "NCCL_NET_PLUGIN": "ofi"})
    assert problem("nccl", {"NCCL_NET": "OFI", "NCCL_NET_PLUGIN": "ofi"},
                   host(libraries=frozenset({"libnccl-net-ofi.so"}))) is None
    assert "NCCL_NET_PLUGIN=spcx names a network plugin" in problem("nccl", {"NCCL_NET_PLUGIN": "spcx"})
    assert problem("nccl", {"NCCL_NET_PLUGIN": "none"}) is None
    # One look-up reads both variables: with both set, the library is looked for once.
    asked: list[str] = []
    counting = HostFabric(INTERFACES, PROVIDERS, lambda name, environ: asked.append(name) is None)
    assert problem("nccl", {"NCCL_NET": "OFI", "NCCL_NET_PLUGIN": "ofi"}, counting) is None
    assert asked == ["libnccl-net-ofi.so"]


def test_libraries_are_found_where_the_linker_looks(tmp_path):
    (tmp_path / "libnccl-net-x.so").write_bytes(b"")
    assert find_shared_library("libnccl-net-x.so", {"LD_LIBRARY_PATH": f"/nonexistent:{tmp_path}"})
    assert not find_shared_library("libnccl-net-x.so", {})
    assert find_shared_library(str(tmp_path / "libnccl-net-x.so"), {})
    assert find_shared_library("libc.so.6", {})  # from the linker cache
    assert "lo" in interface_names()


@pytest.mark.multiproc
def test_unknown_gloo_interface_ends_torchrun_ranks_before_they_wait(tmp_path):
    """The ranks stop at once with one line listing this host's interfaces, exit 2: the first
    rank to fail is torchrun's root cause, and torchrun ends the other (which may not have
    printed its own line yet). No rank waits for the 600 s rendezvous timeout."""
    started = time.monotonic()
    result = run(["torchrun", "--nproc-per-node", "2", "--max-restarts", "0", "-m", "ddp_hpc", "doctor",
                  "--timeout", "600"], env={"GLOO_SOCKET_IFNAME": "nope0", "DDP_HPC_RENDEZVOUS_TIMEOUT": "600"},
                 cwd=tmp_path, timeout=180)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddp-hpc: error:")]
    assert lines, result.stderr
    for line in lines:
        assert re.fullmatch(r"ddp-hpc: error: rank [01] on host \S+: GLOO_SOCKET_IFNAME=nope0 names interface "
                            r"'nope0', which this host does not have \(it has: .*\blo\b.*\)", line), line
    assert not re.search(r'File ".*/ddp_hpc/', result.stderr), result.stderr  # torchrun's own traceback only
    root_cause = result.stderr.split("Root Cause", 1)[1]
    assert re.search(r"exitcode\s+: 2 ", root_cause), result.stderr
    assert elapsed < 120, elapsed  # far below the 600 s rendezvous timeout


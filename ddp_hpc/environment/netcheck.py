"""Network checks before the rendezvous, and the interface gloo uses.

A multi-node job whose names resolve to a loopback address does not fail: it hangs until
the timeout. The classic case is the ``127.0.1.1 <hostname>`` line some installers write
into /etc/hosts: gloo resolves the host name to pick the address it offers its peers,
rank 0's store binds the master address, and both end up on an address no other node can
reach. ``check_network`` finds these before anything connects and names the host, the
rank and the fix in one line.

With a host suffix (a high-speed network's names, e.g. Aurora's ``.hsn...``) the
rendezvous goes to rank 0's suffixed name, but gloo would still pick the address of the
plain host name. ``check_network`` then chooses the interface that carries this host's
suffixed name, and ``gloo_interface`` hands it to gloo for the life of the group.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ddp_hpc.contract import HOST_SUFFIX_VAR
from ddp_hpc.environment.base import DistEnv
from ddp_hpc.environment.hosts import with_suffix
from ddp_hpc.environment.jobs import job_hosts
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915

#: Host name -> its addresses (empty when it does not resolve).
Resolver = Callable[[str], Sequence[str]]


@dataclass(frozen=True)
class NetworkPlan:
    """What the checks decided: the interface gloo must use, or None for gloo's own choice."""

    gloo_ifname: str | None = None
    reason: str = ""


def resolve_addresses(name: str) -> tuple[str, ...]:
    """Every address ``name`` resolves to on this host, in resolver order."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return ()
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


def local_interfaces() -> dict[str, tuple[str, ...]]:
    """Interface name -> its IPv4 address (the primary one), for every interface of this host."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: nothing to check against
        return {}
    interfaces: dict[str, tuple[str, ...]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                interfaces[name] = ()
                continue
            interfaces[name] = (socket.inet_ntoa(answer[20:24]),)
    return interfaces


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _hosts_line(address: str, name: str) -> str:
    return f"'{address} {name}'"


def check_network(dist_env: DistEnv, backend: str, *, host_suffix: str | None,
                  environ: Mapping[str, str], hostname: str | None = None,
                  resolve: Resolver = resolve_addresses,
                  interfaces: Mapping[str, Sequence[str]] | None = None) -> NetworkPlan:
    """Refuse names that cannot work across machines; pick gloo's interface for a host
    suffix. (Reaching the store is the rendezvous handshake's job: ``ddp_hpc/startup/rendezvous.py``.)

    Only multi-node jobs are checked, and loopback names only when some name of the job
    (rank 0's, the first hosts of the node list) is on another machine. Raises
    ``UserError`` naming the rank, the host and the fix.
    """
    if dist_env.num_nodes <= 1:
        return NetworkPlan()
    host = hostname or socket.gethostname()
    where = f"rank {dist_env.rank} on host {host}"
    return _check_names(dist_env, backend, host_suffix, environ, host, where, resolve, interfaces)


#: How many hosts of a job's host list are resolved to tell whether it spans machines: the
#: first is rank 0's, any other is a different node, and every rank of a large job
#: resolving all of them would flood the name service.
HOSTS_TO_PROBE = 4


def listed_hosts(environ: Mapping[str, str]) -> list[str]:
    """The first hosts of the SLURM node list or PBS node file, if the job has one."""
    return job_hosts(environ)[:HOSTS_TO_PROBE]


def other_machine(names: Sequence[str], resolve: Resolver,
                  interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The first of ``names`` that lives on another machine (its address is neither loopback
    nor one of this host's), or None when all of them are here."""
    local = {address for addresses in interfaces.values() for address in addresses}
    for name in names:
        addresses = resolve(name)
        if addresses and not is_loopback(addresses[0]) and addresses[0] not in local:
            return name
    return None


def _check_names(dist_env: DistEnv, backend: str, host_suffix: str | None, environ: Mapping[str, str],
                 host: str, where: str, resolve: Resolver,
                 interfaces: Mapping[str, Sequence[str]] | None) -> NetworkPlan:
    nodes = f"the job spans {dist_env.num_nodes} nodes"
    if interfaces is None:
        interfaces = local_interfaces()
    # Loopback is wrong only where another machine takes part: test clusters run several
    # "nodes" on one machine (all names on 127.0.0.1), and there it is right.
    remote = other_machine([dist_env.master_addr, *listed_hosts(environ)], resolve, interfaces)

    # The first address counts: rank 0's store binds it and gloo offers it (with glibc's
    # "multi on", the 127.0.1.1 line and the real one both come back, loopback first).
    master_addresses = resolve(dist_env.master_addr)
    if not master_addresses:
        raise UserError(f"{where}: the rendezvous host {dist_env.master_addr!r} does not resolve here. Fix: "
                        f"check MASTER_ADDR or the host suffix, or add the name to /etc/hosts (or DNS)")
    if is_loopback(master_addresses[0]) and remote:
        address = master_addresses[0]
        raise UserError(
            f"{where}: the rendezvous host {dist_env.master_addr!r} resolves to {address}, a loopback "
            f"address, but {nodes}: the other nodes cannot reach it. Fix: delete the line "
            f"{_hosts_line(address, dist_env.master_addr)} from /etc/hosts on {host}, or set MASTER_ADDR "
            f"(or the host suffix) to a name on the job's network")

    if backend != "gloo":
        return NetworkPlan()
    suffix = environ.get(HOST_SUFFIX_VAR, "") if host_suffix is None else host_suffix
    ifname = environ.get(GLOO_IFNAME_VAR, "").strip()
    if ifname:
        _check_ifnames(ifname, where, nodes if remote else "", interfaces)
        return NetworkPlan(reason=f"{GLOO_IFNAME_VAR}={ifname}")
    if suffix:
        return _suffix_interface(with_suffix(host, suffix), suffix, where, nodes if remote else "", resolve,
                                 interfaces)

    own = resolve(host)
    if not remote:
        return NetworkPlan(reason=f"host name {host}, all nodes on this machine")
    if not own:
        raise UserError(
            f"{where}: the host name {host!r} does not resolve, so gloo would fall back to the loopback "
            f"address, but {nodes}. Fix: add {host} with its network address to /etc/hosts (or DNS), "
            f"or export {GLOO_IFNAME_VAR}=<the interface of the job's network>")
    if is_loopback(own[0]):
        raise UserError(
            f"{where}: the host name {host!r} resolves to {own[0]}, a loopback address, so gloo would "
            f"offer the other ranks an address they cannot reach ({nodes}). Fix: delete the line "
            f"{_hosts_line(own[0], host)} from /etc/hosts on {host}, or export "
            f"{GLOO_IFNAME_VAR}=<the interface of the job's network>")
    return NetworkPlan(reason=f"host name {host} ({own[0]})")


def _check_ifnames(value: str, where: str, nodes: str, interfaces: Mapping[str, Sequence[str]]) -> None:
    for name in (part.strip() for part in value.split(",")):
        if name not in interfaces:
            raise UserError(f"{where}: {GLOO_IFNAME_VAR}={value} names interface {name!r}, which this "
                            f"host does not have (it has: {', '.join(sorted(interfaces)) or 'none'})")
        addresses = interfaces[name]
        if not addresses:
            raise UserError(f"{where}: {GLOO_IFNAME_VAR}={value}: interface {name!r} has no IPv4 address")
        if nodes and all(is_loopback(a) for a in addresses):
            raise UserError(f"{where}: {GLOO_IFNAME_VAR}={value} is the loopback interface, but {nodes}: "
                            f"name the interface of the job's network instead")


def _suffix_interface(name: str, suffix: str, where: str, nodes: str, resolve: Resolver,
                      interfaces: Mapping[str, Sequence[str]]) -> NetworkPlan:
    addresses = resolve(name)
    if not addresses:
        raise UserError(f"{where}: the host suffix {suffix!r} gives {name!r}, which does not resolve "
                        f"here. Fix: check the suffix (--host-suffix, {HOST_SUFFIX_VAR}, the cluster "
                        f"profile's host_suffix) or export {GLOO_IFNAME_VAR}")
    if nodes and is_loopback(addresses[0]):
        raise UserError(f"{where}: {name!r} resolves to {addresses[0]}, a loopback address, but {nodes}. "
                        f"Fix: delete the line {_hosts_line(addresses[0], name)} from /etc/hosts")
    for ifname, own in interfaces.items():
        if set(own) & set(addresses):
            return NetworkPlan(gloo_ifname=ifname, reason=f"{name} ({addresses[0]}, host suffix {suffix!r})")
    raise UserError(f"{where}: {name!r} (host suffix {suffix!r}) resolves to {', '.join(addresses)}, "
                    f"which is not an address of this host, so gloo cannot use that network. Fix: "
                    f"check the suffix, or export {GLOO_IFNAME_VAR}=<the interface of the job's network>")


@contextmanager
def gloo_interface(plan: NetworkPlan) -> Iterator[None]:
    """Give gloo the planned interface while the block runs (torch reads it from the
    environment when it creates the gloo process group; there is no argument for it)."""
    if plan.gloo_ifname is None or GLOO_IFNAME_VAR in os.environ:
        yield
        return
    log.debug("gloo uses interface %s: %s", plan.gloo_ifname, plan.reason)
    os.environ[GLOO_IFNAME_VAR] = plan.gloo_ifname
    try:
        yield
    finally:
        os.environ.pop(GLOO_IFNAME_VAR, None)

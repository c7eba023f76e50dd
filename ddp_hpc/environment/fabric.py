"""Fabric variables checked before any rank waits.

A variable that names an interface, a libfabric provider or an NCCL network plugin this
host does not have does not fail at once: gloo raises on one rank while the others wait
for it, NCCL and oneCCL fall back or hang until the collective timeout. ``check_fabric``
reads the variables (through the mapping it is given, as the rest of environment/ does),
compares them with what this host has, and raises one ``UserError`` line that lists what
the host has instead.

How each library reads its variable (the syntax checked here):

- ``GLOO_SOCKET_IFNAME``: torch splits it on ``,`` and creates one gloo device per name;
  each name is an exact interface name.
- ``NCCL_SOCKET_IFNAME``: a ``,`` list of prefixes; ``^`` in front excludes what the
  list matches instead, ``=`` in front of an entry makes it an exact name (``^=docker0``).
- ``CCL_KVS_IFACE``: oneCCL's key-value store interface, one exact name.
- ``FI_PROVIDER``: libfabric's ``,`` list of providers, ``^`` in front excludes them.
  Checked where ``fi_info`` can list this host's providers.
- ``NCCL_NET``: ``IB`` and ``Socket`` are built into NCCL; any other network comes from a
  plugin library, ``libnccl-net-$NCCL_NET_PLUGIN.so`` (or ``$NCCL_NET_PLUGIN`` when it is
  a library name or path) or else ``libnccl-net.so``, which must be found.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME_VAR = "NCCL_SOCKET_IFNAME"
CCL_IFACE_VAR = "CCL_KVS_IFACE"
FI_PROVIDER_VAR = "FI_PROVIDER"
NCCL_NET_VAR = "NCCL_NET"
NCCL_NET_PLUGIN_VAR = "NCCL_NET_PLUGIN"
NCCL_BUILTIN_NETS = frozenset({"ib", "socket"})

#: Which backends read which variables. gloo's is checked for every backend: torch creates
#: gloo groups for CPU tensors next to nccl and xccl ones (``new_group(backend="gloo")``).
BACKEND_VARIABLES: Mapping[str, tuple[str, ...]] = {
    "gloo": (GLOO_IFNAME_VAR,),
    "nccl": (GLOO_IFNAME_VAR, NCCL_IFNAME_VAR, NCCL_NET_VAR, NCCL_NET_PLUGIN_VAR),
    "xccl": (GLOO_IFNAME_VAR, CCL_IFACE_VAR, FI_PROVIDER_VAR),
    "ccl": (GLOO_IFNAME_VAR, CCL_IFACE_VAR, FI_PROVIDER_VAR),
}


@dataclass(frozen=True)
class HostFabric:
    """What this host has: its interface names, its libfabric providers (None: unknown),
    and a way to tell whether a shared library can be found."""

    interfaces: Collection[str]
    providers: Collection[str] | None
    find_library: Callable[[str, Mapping[str, str]], bool]  # (library name or path, environ) -> found


def _listing(names: Iterable[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def gloo_ifname_problem(value: str, interfaces: Collection[str]) -> str | None:
    names = [name.strip() for name in value.split(",") if name.strip()]
    missing = [name for name in names if name not in interfaces]
    if not missing:
        return None
    return (f"{GLOO_IFNAME_VAR}={value} names interface {missing[0]!r}, which this host does not have "
            f"(it has: {_listing(interfaces)})")


def nccl_ifname_matches(value: str, interfaces: Collection[str]) -> list[str]:
    """The interfaces NCCL would consider under ``NCCL_SOCKET_IFNAME=value``."""
    exclude = value.startswith("^")
    entries = [entry.strip() for entry in value.lstrip("^").split(",") if entry.strip()]

    def matches(name: str, entry: str) -> bool:
        return name == entry[1:] if entry.startswith("=") else name.startswith(entry)

    return sorted(name for name in interfaces
                  if any(matches(name, entry) for entry in entries) != exclude)


def nccl_ifname_problem(value: str, interfaces: Collection[str]) -> str | None:
    if nccl_ifname_matches(value, interfaces):
        return None
    what = "leaves no interface" if value.startswith("^") else "matches no interface"
    return f"{NCCL_IFNAME_VAR}={value} {what} of this host (it has: {_listing(interfaces)})"


def ccl_iface_problem(value: str, interfaces: Collection[str]) -> str | None:
    if value in interfaces:
        return None
    return (f"{CCL_IFACE_VAR}={value} names interface {value!r}, which this host does not have "
            f"(it has: {_listing(interfaces)})")


def fi_provider_problem(value: str, providers: Collection[str]) -> str | None:
    exclude = value.startswith("^")
    names = [name.strip() for name in value.lstrip("^").split(",") if name.strip()]
    if exclude:
        if set(providers) - set(names):
            return None
        return f"{FI_PROVIDER_VAR}={value} excludes every libfabric provider of this host (it has: " \
               f"{_listing(providers)})"
    # A provider layered on a core one (e.g. "verbs;ofi_rxm") counts by its core name.
    missing = [name for name in names if name.split(";")[0] not in providers]
    if not missing:
        return None
    return (f"{FI_PROVIDER_VAR}={value} names libfabric provider {missing[0]!r}, which this host does not "
            f"have (it has: {_listing(providers)})")


def nccl_plugin_library(environ: Mapping[str, str]) -> str:
    """The library NCCL loads for a network plugin (NCCL_NET_PLUGIN: a suffix, or a name or path)."""
    plugin = environ.get(NCCL_NET_PLUGIN_VAR, "").strip()
    if not plugin:
        return "libnccl-net.so"
    if "/" in plugin or ".so" in plugin:
        return plugin
    return f"libnccl-net-{plugin}.so"


LibraryFinder = Callable[[str, Mapping[str, str]], bool]


def nccl_net_problem(environ: Mapping[str, str], find_library: LibraryFinder) -> str | None:
    net = environ.get(NCCL_NET_VAR, "").strip()
    plugin = environ.get(NCCL_NET_PLUGIN_VAR, "").strip()
    needs_plugin = (net and net.lower() not in NCCL_BUILTIN_NETS) or (plugin and plugin.lower() != "none")
    if not needs_plugin:
        return None
    library = nccl_plugin_library(environ)
    if find_library(library, environ):
        return None
    if net and net.lower() not in NCCL_BUILTIN_NETS:
        named = f"{NCCL_NET_VAR}={net} is not built into NCCL (IB, Socket) and needs a network plugin"
    else:
        named = f"{NCCL_NET_PLUGIN_VAR}={plugin} names a network plugin"
    return (f"{named}, but its library {library} is not found (searched LD_LIBRARY_PATH and the linker "
            f"cache): add its folder to LD_LIBRARY_PATH or fix {NCCL_NET_PLUGIN_VAR}")


def check_fabric(backend: str, environ: Mapping[str, str], host: HostFabric, *, where: str) -> None:
    """Raise ``UserError`` (one line, prefixed with ``where``) for the first fabric variable
    of ``backend`` that names something this host lacks."""
    variables = BACKEND_VARIABLES.get(backend, (GLOO_IFNAME_VAR,))
    problem = None
    net_checked = False
    for variable in variables:
        value = environ.get(variable, "").strip()
        if not value:
            continue
        if variable == GLOO_IFNAME_VAR:
            problem = gloo_ifname_problem(value, host.interfaces)
        elif variable == NCCL_IFNAME_VAR:
            problem = nccl_ifname_problem(value, host.interfaces)
        elif variable == CCL_IFACE_VAR:
            problem = ccl_iface_problem(value, host.interfaces)
        elif variable == FI_PROVIDER_VAR:
            if host.providers is None:
                log.debug("%s=%s not checked: fi_info is not on PATH", variable, value)
            else:
                problem = fi_provider_problem(value, host.providers)
        elif variable in (NCCL_NET_VAR, NCCL_NET_PLUGIN_VAR) and not net_checked:
            net_checked = True  # one check reads both (and may ask ldconfig): not twice
            problem = nccl_net_problem(environ, host.find_library)
        if problem:
            raise UserError(f"{where}: {problem}")


# --- what this host has -------------------------------------------------------------------

def interface_names() -> tuple[str, ...]:
    """The names of this host's network interfaces (of its network namespace)."""
    try:
        return tuple(name for _, name in socket.if_nameindex())
    except OSError:
        return ()


def libfabric_providers(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """libfabric's providers on this host (``fi_info -l``), or None when that cannot be asked."""
    fi_info = shutil.which("fi_info", path=environ.get("PATH"))
    if fi_info is None:
        return None
    env = {k: v for k, v in environ.items() if k != FI_PROVIDER_VAR}  # list all, not the filtered few
    try:
        out = subprocess.run([fi_info, "-l"], capture_output=True, text=True, timeout=30, env=env).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tuple(line.strip().rstrip(":") for line in out.splitlines()
                 if line.strip().endswith(":") and not line.startswith((" ", "\t")))


def find_shared_library(library: str, environ: Mapping[str, str]) -> bool:
    """Whether the dynamic linker would find ``library`` (a path, or a name searched in
    LD_LIBRARY_PATH, the linker cache and the usual folders)."""
    if "/" in library:
        return Path(library).is_file()
    for folder in environ.get("LD_LIBRARY_PATH", "").split(":"):
        if folder and (Path(folder) / library).is_file():
            return True
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if ldconfig:
        try:
            cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            cache = ""
        if any(line.strip().startswith(library + " ") for line in cache.splitlines()):
            return True
    return any((Path(folder) / library).is_file()
               for folder in ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib"))


def where_label(rank: int, world_size: int) -> str:
    """``rank 1 on host h2`` in a multi-rank job, ``host h2`` alone."""
    host = socket.gethostname()
    return f"rank {rank} on host {host}" if world_size > 1 else f"host {host}"


def this_host(environ: Mapping[str, str]) -> HostFabric:
    """What this host has; the provider list is asked for only where it would be read."""
    providers = libfabric_providers(environ) if environ.get(FI_PROVIDER_VAR, "").strip() else None
    return HostFabric(interfaces=interface_names(), providers=providers, find_library=find_shared_library)

"""Copy a packed environment to node-local disk on every node: a tree, one copy per node.

One process per node (``srun --ntasks-per-node=1``, ``mpiexec -ppn 1``) runs
:func:`stage_on_node`. Node 0 reads the archive from the shared file system, the only read
of it; every node streams what it receives on to its children in a binary tree (node i
feeds 2i+1 and 2i+2) while writing its own copy, so the copy reaches N nodes in about one
copy's time plus log2(N) hops, and no node sends more than two streams. Nodes find their
parent through small address files in a shared rendezvous folder. Each node then unpacks
its copy into ``ROOT/<node name>`` (under a temporary name, renamed when whole).

The node name (``$SLURMD_NODENAME``, else the short host name) is part of the path so
that nodes sharing one ``/tmp`` (several node daemons on one host, as in the test cluster)
still get a copy each; the rendered scripts find it the same way (:data:`NODE_NAME_SHELL`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import atomic_write
from ddp_hpc.environment import detect_launcher
from ddp_hpc.errors import UserError

log = logging.getLogger(__name__)

#: The same node name in a shell (the rendered scripts' rank wrapper).
NODE_NAME_SHELL = "${SLURMD_NODENAME:-$(hostname -s)}"
_CHUNK = 4 << 20
_SIZE = struct.Struct("!Q")
_INDEX = struct.Struct("!I")


class StageError(UserError):
    """A node could not get or unpack its copy: one line naming the node and the cause."""


@dataclass(frozen=True)
class NodeSlot:
    """This node's place in the copy tree."""

    index: int
    count: int
    name: str

    @property
    def parent(self) -> int | None:
        return None if self.index == 0 else (self.index - 1) // 2

    @property
    def children(self) -> tuple[int, ...]:
        return tuple(c for c in (2 * self.index + 1, 2 * self.index + 2) if c < self.count)


@dataclass(frozen=True)
class StagedCopy:
    """One node's copy: where it lies, where it came from, and how long it took."""

    node: NodeSlot
    path: Path
    source: str
    size_bytes: int
    seconds: float


def node_name(environ: Mapping[str, str]) -> str:
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def node_slot(environ: Mapping[str, str]) -> NodeSlot:
    """Index and count from the launcher that started one process per node."""
    info = detect_launcher(environ).ranks(environ)
    return NodeSlot(info.rank, info.world_size, node_name(environ))


def staged_path(root: Path, environ: Mapping[str, str]) -> Path:
    return root / node_name(environ)


def _address_file(rendezvous: Path, index: int) -> Path:
    return rendezvous / f"node-{index}.json"


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return bytes(data)


def _connect_to_parent(slot: NodeSlot, rendezvous: Path, give_up_at: float) -> socket.socket:
    parent = slot.parent
    address_file = _address_file(rendezvous, parent)
    last_error = "no address file yet"
    while time.monotonic() < give_up_at:
        try:
            address = json.loads(address_file.read_text())
            sock = socket.create_connection((address["host"], address["port"]), timeout=10)
            sock.settimeout(max(1.0, give_up_at - time.monotonic()))
            sock.sendall(_INDEX.pack(slot.index))
            return sock
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError) as exc:
            last_error = str(exc)
        time.sleep(0.2)
    raise StageError(f"stage: node {slot.index} ({slot.name}) got nothing from its parent, node {parent}, "
                     f"before the timeout ({last_error}; its address file is {address_file}): see node {parent}'s "
                     "output")


def _accept_children(server: socket.socket, slot: NodeSlot, give_up_at: float) -> list[socket.socket]:
    children = []
    waiting = set(slot.children)
    while waiting:
        server.settimeout(max(0.1, give_up_at - time.monotonic()))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            raise StageError(f"stage: node {slot.index} ({slot.name}): node(s) "
                             f"{', '.join(map(str, sorted(waiting)))} never connected to receive their copy") from None
        conn.settimeout(max(1.0, give_up_at - time.monotonic()))
        index = _INDEX.unpack(_read_exact(conn, _INDEX.size))[0]
        waiting.discard(index)
        children.append(conn)
    return children


def _untar(partial: Path) -> subprocess.Popen:
    """GNU tar reading the archive from its stdin into ``partial`` (C speed, no second copy
    of the archive on the node's disk)."""
    partial.mkdir(parents=True)
    try:
        return subprocess.Popen(["tar", "-x", "-f", "-", "-C", str(partial)], stdin=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise StageError("stage: no `tar` on this node: it unpacks the copy") from None


def _stream(slot: NodeSlot, archive: Path, rendezvous: Path, partial: Path, host_suffix: str,
            give_up_at: float) -> tuple[str, int]:
    """Receive (node 0: read) the archive, send it on to the children and unpack it into
    ``partial``, all in one pass over the bytes."""
    server = upstream = reader = untar = None
    if slot.children:
        server = socket.create_server(("", 0), backlog=len(slot.children))
        host = socket.gethostname().split(".")[0] + host_suffix
        atomic_write(_address_file(rendezvous, slot.index),
                     json.dumps({"host": host, "port": server.getsockname()[1]}), durable=False)
    try:
        if slot.parent is None:
            source, size, reader = str(archive), archive.stat().st_size, open(archive, "rb")
            read = reader.read
        else:
            upstream = _connect_to_parent(slot, rendezvous, give_up_at)
            size = _SIZE.unpack(_read_exact(upstream, _SIZE.size))[0]
            source, read = f"node {slot.parent}", upstream.recv
        children = _accept_children(server, slot, give_up_at) if server is not None else []
        for child in children:
            child.sendall(_SIZE.pack(size))
        untar = _untar(partial)
        received = 0
        while received < size:
            chunk = read(min(_CHUNK, size - received))
            if not chunk:
                raise StageError(f"stage: node {slot.index} ({slot.name}): {source} ended after "
                                 f"{received} of {size} bytes")
            for child in children:
                child.sendall(chunk)
            untar.stdin.write(chunk)
            received += len(chunk)
        untar.stdin.close()
        if untar.wait() != 0:
            raise StageError(f"stage: node {slot.index} ({slot.name}): tar could not unpack the copy into "
                             f"{partial.parent}: {untar.stderr.read().decode(errors='replace').strip()[-300:]}")
        for child in children:
            child.shutdown(socket.SHUT_WR)
            child.recv(1)  # the child closes once it has every byte
            child.close()
        return source, size
    except OSError as exc:
        raise StageError(f"stage: node {slot.index} ({slot.name}): copy failed: {exc}") from None
    finally:
        for handle in (reader, upstream, server):
            if handle is not None:
                handle.close()
        if untar is not None and untar.poll() is None:
            untar.kill()
            untar.wait()


def stage_on_node(archive: str | os.PathLike[str], root: str | os.PathLike[str], rendezvous: str | os.PathLike[str],
                  slot: NodeSlot, *, host_suffix: str = "", timeout_s: float = 600.0) -> StagedCopy:
    """This node's part of the copy: receive the archive (node 0: read it), pass it on to
    the children, unpack it into ``root/<node name>`` (renamed there when whole)."""
    start = time.monotonic()
    archive, root, rendezvous = Path(archive), Path(root), Path(rendezvous)
    if slot.parent is None and not archive.is_file():
        raise StageError(f"stage: no archive {archive}: make it with `ddp-hpc stage pack`")
    root.mkdir(parents=True, exist_ok=True)
    rendezvous.mkdir(parents=True, exist_ok=True)
    dest = root / slot.name
    partial = root / f".{slot.name}.partial-{os.getpid()}"
    try:
        source, size = _stream(slot, archive, rendezvous, partial, host_suffix, start + timeout_s)
        if dest.exists():  # staged earlier under the same job id (a requeue): replaced, it can be rebuilt
            shutil.rmtree(dest)
        os.replace(partial, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return StagedCopy(slot, dest, source, size, time.monotonic() - start)


_IMPORT_PROBE = ("import json, sys, time; t = time.perf_counter(); import {module} as m; "
                 "print(json.dumps([time.perf_counter() - t, m.__file__]))")


@dataclass(frozen=True)
class ImportTime:
    seconds: float
    module_file: str


def time_import(python: str | os.PathLike[str], module: str) -> ImportTime:
    """How long ``import module`` takes in a fresh ``python``, and where the module lies."""
    result = subprocess.run([str(python), "-c", _IMPORT_PROBE.format(module=module)], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise StageError(f"stage: {python} cannot import {module}: {result.stderr.strip().splitlines()[-1:]}")
    seconds, module_file = json.loads(result.stdout.strip().splitlines()[-1])
    return ImportTime(seconds, module_file)


def compare_import(copy: StagedCopy, module: str) -> tuple[ImportTime, ImportTime]:
    """``import module`` from the shared environment (this Python), then from the node-local copy."""
    return time_import(sys.executable, module), time_import(copy.path / "bin" / "python", module)

"""The launch's recovery store without torch: a server that speaks torch's ``TCPStore`` wire
protocol, and a client of it for the node supervisors.

``ddp-hpc launch --recover`` serves the store the ranks meet in (``store.py``). Serving it
with ``torch.distributed.TCPStore(is_master=True)`` made the launch import torch (about
200 MB of the launch's memory, and seconds of its start); this module is the standard
library only. The ranks keep torch's own client (``dist.TCPStore(host, port,
is_master=False)``, ``PrefixStore``s over it, ``init_process_group`` over those) of every
torch this project supports (2.5.1 to 2.14.1: their clients send the same requests).

The protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, TCPStore.cpp,
TCPStoreLibUvBackend.cpp): a client's first request is ``VALIDATE`` and the magic number;
then each request is one ``QueryType`` byte and its arguments, integers in the machine's
byte order (little-endian on every platform torch builds for): lengths and counts uint64,
``ADD``'s and the replies' counts int64, ``PING``'s nonce uint32; a key or a value is its
uint64 length and its bytes. Keys arrive as the client wrote them (torch's client puts
``/`` before each; ``StoreClient`` does the same, so both see one set of keys). A ``GET``
or ``MULTI_GET`` client waits for its keys first (``WAIT``), so a missing key reads as empty.
``WAIT`` is answered ``STOP_WAITING`` once every key exists; a client whose wait timed out
sends ``CANCEL_WAIT`` and reads ``WAIT_CANCELED`` (after a ``STOP_WAITING`` that crossed it).

One thread serves every connection (``selectors``); the keys live in one dict only that
thread touches, so no request needs a lock and a waiter is answered by the request that
sets its last key.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Union

log = logging.getLogger(__name__)

MAGIC = 0x3C85F7CE

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET, \
    CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN = range(17)
READY, NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1

_U8, _U32, _U64, _I64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q")
#: torch's own limits on a request (TCPStoreLibUvBackend.cpp): a client that sends more is broken.
MAX_KEY_COUNT = 128 * 1024
MAX_STRING_LEN = 8 * 1024
MAX_PAYLOAD_LEN = 8 * 1024 * 1024
#: The key prefix torch's client puts before every key.
KEY_PREFIX = "/"
#: torch's client's default timeout.
DEFAULT_TIMEOUT = timedelta(seconds=300)

Value = Union[str, bytes]


class StoreError(RuntimeError):
    """A request to the store failed: it timed out, or the connection broke."""


class StoreTimeout(StoreError):
    """A wait (``wait``, ``get``, ``multi_get``) ran past its timeout."""


class _Incomplete(Exception):
    """The request is not all there yet."""


class _Broken(Exception):
    """The client sent what no torch client sends: its connection is closed."""


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    validated: bool = False
    #: The keys its pending ``WAIT`` still misses.
    awaiting: set[bytes] = field(default_factory=set)


class _Reader:
    def __init__(self, data: bytearray) -> None:
        self.data, self.at = data, 0

    def _take(self, size: int) -> bytes:
        if self.at + size > len(self.data):
            raise _Incomplete
        chunk = bytes(self.data[self.at:self.at + size])
        self.at += size
        return chunk

    def u8(self) -> int:
        return _U8.unpack(self._take(1))[0]

    def u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self._take(8))[0]

    def i64(self) -> int:
        return _I64.unpack(self._take(8))[0]

    def key(self) -> bytes:
        size = self.u64()
        if size > MAX_STRING_LEN:
            raise _Broken(f"a key of {size} bytes")
        return self._take(size)

    def value(self) -> bytes:
        size = self.u64()
        if size > MAX_PAYLOAD_LEN:
            raise _Broken(f"a value of {size} bytes")
        return self._take(size)

    def count(self) -> int:
        count = self.u64()
        if count > MAX_KEY_COUNT:
            raise _Broken(f"{count} keys in one request")
        return count


def _vector(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _listen(port: int, backlog: int) -> socket.socket:
    """A socket on ``port`` of every interface, IPv6 and IPv4 where the host has both (as
    torch's server listens: the address the clients are told may be any name of this host)."""
    try:
        listener = socket.create_server(("", port), family=socket.AF_INET6, backlog=backlog, reuse_port=False,
                                        dualstack_ipv6=True)
    except (OSError, ValueError):
        listener = socket.create_server(("", port), family=socket.AF_INET, backlog=backlog)
    return listener


class StoreServer:
    """Serves the store on ``port`` of every interface (0: a free port, ``port`` after)
    from a daemon thread, until ``close``."""

    def __init__(self, port: int = 0, backlog: int = 1024) -> None:
        self._listener = _listen(port, backlog)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiters: dict[bytes, list[_Connection]] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="ddp_hpc-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops serving and closes every connection."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=10)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for event_key, events in self._selector.select():
                    conn = event_key.data
                    if event_key.fileobj is self._listener:
                        self._accept()
                    elif event_key.fileobj is self._wake_read:
                        continue
                    elif events & selectors.EVENT_READ and not self._receive(conn):
                        continue
                    elif events & selectors.EVENT_WRITE:
                        self._flush(conn)
        finally:
            for event_key in list(self._selector.get_map().values()):
                event_key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_write.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._selector.register(sock, selectors.EVENT_READ, _Connection(sock))

    def _receive(self, conn: _Connection) -> bool:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return False
        conn.inbox += chunk
        try:
            while conn.inbox:
                reader = _Reader(conn.inbox)
                try:
                    self._handle(conn, reader)
                except _Incomplete:
                    break
                del conn.inbox[:reader.at]
        except (_Broken, ValueError) as exc:
            log.debug("recovery store: closing a client that sent %s", exc)
            self._drop(conn)
            return False
        self._flush(conn)
        return True

    def _flush(self, conn: _Connection) -> None:
        if conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)
                del conn.outbox[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._drop(conn)
                return
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbox else 0)
        if self._selector.get_key(conn.sock).events != wanted:
            self._selector.modify(conn.sock, wanted, conn)

    def _drop(self, conn: _Connection) -> None:
        self._cancel_wait(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _handle(self, conn: _Connection, request: _Reader) -> None:
        query = request.u8()
        if not conn.validated:
            if query != VALIDATE or request.u32() != MAGIC:
                raise _Broken("no validation first")
            conn.validated = True
            return
        out = conn.outbox
        if query == PING:
            out += _U32.pack(request.u32())
        elif query == SET:
            key, value = request.key(), request.value()
            self._set(key, value)
        elif query == COMPARE_SET:
            key, expected, desired = request.key(), request.value(), request.value()
            out += _vector(self._compare_set(key, expected, desired))
        elif query == GET:
            out += _vector(self._data.get(request.key(), b""))
        elif query == ADD:
            key, amount = request.key(), request.i64()
            total = int(self._data.get(key, b"0")) + amount
            self._set(key, str(total).encode())
            out += _I64.pack(total)
        elif query == CHECK:
            keys = [request.key() for _ in range(request.count())]
            out += _U8.pack(READY if all(self._exists(key) for key in keys) else NOT_READY)
        elif query == WAIT:
            keys = [request.key() for _ in range(request.count())]
            missing = {key for key in keys if not self._exists(key)}
            if missing:
                self._cancel_wait(conn)
                conn.awaiting = missing
                for key in missing:
                    self._waiters.setdefault(key, []).append(conn)
            else:
                out += _U8.pack(STOP_WAITING)
        elif query == GETNUMKEYS:
            out += _I64.pack(len(self._data))
        elif query == DELETE_KEY:
            out += _I64.pack(1 if self._data.pop(request.key(), None) is not None else 0)
        elif query == APPEND:
            key, value = request.key(), request.value()
            self._set(key, self._data.get(key, b"") + value)
        elif query == MULTI_GET:
            keys = [request.key() for _ in range(request.count())]
            for key in keys:
                out += _vector(self._data.get(key, b""))
        elif query == MULTI_SET:
            pairs = [(request.key(), request.value()) for _ in range(request.count())]
            for key, value in pairs:
                self._set(key, value)
        elif query == CANCEL_WAIT:
            self._cancel_wait(conn)
            out += _U8.pack(WAIT_CANCELED)
        elif query == QUEUE_PUSH:
            key, value = request.key(), request.value()
            self._queues.setdefault(key, deque()).append(value)
            self._wake(key, one=True)
        elif query == QUEUE_POP:
            queue = self._queues.get(request.key())
            out += _I64.pack(len(queue) if queue else 0)
            if queue:
                out += _vector(queue.popleft())
        elif query == QUEUE_LEN:
            queue = self._queues.get(request.key())
            out += _I64.pack(len(queue) if queue else 0)
        else:
            raise _Broken(f"query type {query}")

    def _exists(self, key: bytes) -> bool:
        return key in self._data or bool(self._queues.get(key))

    def _set(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake(key)

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self._data.get(key)
        if current is None:
            if expected:
                return expected  # what torch's servers answer: the caller's own expectation
            self._set(key, desired)
            return desired
        if current == expected:
            self._set(key, desired)
            return desired
        return current

    def _wake(self, key: bytes, one: bool = False) -> None:
        waiting = self._waiters.get(key)
        if not waiting:
            return
        for conn in list(waiting):
            conn.awaiting.discard(key)
            waiting.remove(conn)
            if not conn.awaiting:
                conn.outbox += _U8.pack(STOP_WAITING)
                self._flush(conn)
                if one:
                    break
        if not waiting:
            self._waiters.pop(key, None)

    def _cancel_wait(self, conn: _Connection) -> None:
        for key in conn.awaiting:
            waiting = self._waiters.get(key, [])
            if conn in waiting:
                waiting.remove(conn)
            if not waiting:
                self._waiters.pop(key, None)
        conn.awaiting = set()


def _encode(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class StoreClient:
    """A client of a torch ``TCPStore`` (``StoreServer``, or torch's own): the requests
    ``LaunchStore`` makes, with the names and results of torch's ``Store`` methods.
    ``timeout``: how long ``wait`` and ``get`` wait for their keys (torch's 300 s by
    default), and how long ``__init__`` tries to connect. One request at a time (a lock)."""

    def __init__(self, host: str, port: int, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        self.host, self.port = host, port
        self.timeout_s = _seconds(timeout, DEFAULT_TIMEOUT.total_seconds())
        self._lock = threading.Lock()
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        give_up_at = time.monotonic() + self.timeout_s
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(1.0, give_up_at - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() + delay > give_up_at:
                    raise StoreError(f"cannot reach the store at {self.host}:{self.port}: {exc}") from exc
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout_s)  # as torch's client: no reply in that long is an error
        sock.sendall(_U8.pack(VALIDATE) + _U32.pack(MAGIC))
        return sock

    def close(self) -> None:
        self._sock.close()

    # -- the wire ------------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        return _vector((KEY_PREFIX + key).encode())

    def _keys(self, keys: Sequence[str]) -> bytes:
        return _U64.pack(len(keys)) + b"".join(self._key(key) for key in keys)

    def _exactly(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            try:
                chunk = self._sock.recv(left)
            except TimeoutError:
                raise
            except OSError as exc:
                raise StoreError(f"the store at {self.host}:{self.port} is gone: {exc}") from exc
            if not chunk:
                raise StoreError(f"the store at {self.host}:{self.port} closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _reply(self, size: int) -> bytes:
        try:
            return self._exactly(size)
        except TimeoutError as exc:
            raise StoreError(f"the store at {self.host}:{self.port} did not answer in {self.timeout_s:g} s") from exc

    def _vector_reply(self) -> bytes:
        return self._reply(_U64.unpack(self._reply(8))[0])

    def _request(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise StoreError(f"the store at {self.host}:{self.port} is gone: {exc}") from exc

    def _wait(self, keys: Sequence[str], timeout_s: float) -> None:
        self._request(_U8.pack(WAIT) + self._keys(keys))
        self._sock.settimeout(timeout_s)
        try:
            reply = self._exactly(1)
        except TimeoutError:
            reply = None
        finally:
            self._sock.settimeout(self.timeout_s)
        if reply is not None:
            if reply[0] != STOP_WAITING:
                raise StoreError(f"the store answered a wait with {reply[0]}")
            return
        self._request(_U8.pack(CANCEL_WAIT))
        if self._reply(1)[0] != WAIT_CANCELED:  # the keys came as it timed out
            self._reply(1)
        raise StoreTimeout(f"wait timeout after {timeout_s * 1000:.0f}ms, keys: {list(keys)}")

    # -- torch's Store methods -----------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        with self._lock:
            self._request(_U8.pack(SET) + self._key(key) + _vector(_encode(value)))

    def get(self, key: str) -> bytes:
        with self._lock:
            self._wait([key], self.timeout_s)
            self._request(_U8.pack(GET) + self._key(key))
            return self._vector_reply()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._request(_U8.pack(ADD) + self._key(key) + _I64.pack(amount))
            return _I64.unpack(self._reply(8))[0]

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        with self._lock:
            self._request(_U8.pack(COMPARE_SET) + self._key(key) + _vector(_encode(expected))
                          + _vector(_encode(desired)))
            return self._vector_reply()

    def check(self, keys: Sequence[str]) -> bool:
        with self._lock:
            self._request(_U8.pack(CHECK) + self._keys(keys))
            return self._reply(1)[0] == READY

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        with self._lock:
            self._wait(keys, _seconds(timeout, self.timeout_s))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._lock:
            self._wait(keys, self.timeout_s)
            self._request(_U8.pack(MULTI_GET) + self._keys(keys))
            return [self._vector_reply() for _ in keys]

    def multi_set(self, keys: Sequence[str], values: Iterable[Value]) -> None:
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"multi_set: {len(keys)} keys, {len(values)} values")
        with self._lock:
            self._request(_U8.pack(MULTI_SET) + _U64.pack(len(keys))
                          + b"".join(self._key(key) + _vector(_encode(value)) for key, value in zip(keys, values)))

    def append(self, key: str, value: Value) -> None:
        with self._lock:
            self._request(_U8.pack(APPEND) + self._key(key) + _vector(_encode(value)))

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._request(_U8.pack(DELETE_KEY) + self._key(key))
            return _I64.unpack(self._reply(8))[0] == 1

    def num_keys(self) -> int:
        with self._lock:
            self._request(_U8.pack(GETNUMKEYS))
            return _I64.unpack(self._reply(8))[0]

    def ping(self, nonce: int = 0) -> bool:
        with self._lock:
            self._request(_U8.pack(PING) + _U32.pack(nonce))
            return _U32.unpack(self._reply(4))[0] == nonce

"""The launch's recovery store without torch: a server that speaks torch's ``TCPStore`` wire
protocol (``store_protocol.py``); its client for the node supervisors is ``store_client.py``.

``ddp-hpc launch --recover`` serves the store the ranks meet in (``store.py``). Serving it
with ``torch.distributed.TCPStore(is_master=True)`` made the launch import torch (about
200 MB of the launch's memory, and seconds of its start); this module is the standard
library only. The ranks keep torch's own client (``dist.TCPStore(host, port,
is_master=False)``, ``PrefixStore``s over it, ``init_process_group`` over those) of every
torch this project supports (2.5.1 to 2.14.1: their clients send the same requests).

One thread serves every connection (``selectors``); the keys live in one dict only that
thread touches, so no request needs a lock and a waiter is answered by the request that
sets its last key.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections import deque
from dataclasses import dataclass, field

from ddp_hpc.engine.recovery.store_protocol import (
    ADD, APPEND, CANCEL_WAIT, CHECK, COMPARE_SET, DELETE_KEY, GET, GETNUMKEYS, I64, MAGIC, MAX_KEY_COUNT,
    MAX_PAYLOAD_LEN, MAX_STRING_LEN, MULTI_GET, MULTI_SET, NOT_READY, PING, QUEUE_LEN, QUEUE_POP, QUEUE_PUSH, READY,
    SET, STOP_WAITING, U8, U32, U64, VALIDATE, WAIT, WAIT_CANCELED, vector)

log = logging.getLogger(__name__)


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
        return U8.unpack(self._take(1))[0]

    def u32(self) -> int:
        return U32.unpack(self._take(4))[0]

    def u64(self) -> int:
        return U64.unpack(self._take(8))[0]

    def i64(self) -> int:
        return I64.unpack(self._take(8))[0]

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
            out += U32.pack(request.u32())
        elif query == SET:
            key, value = request.key(), request.value()
            self._set(key, value)
        elif query == COMPARE_SET:
            key, expected, desired = request.key(), request.value(), request.value()
            out += vector(self._compare_set(key, expected, desired))
        elif query == GET:
            out += vector(self._data.get(request.key(), b""))
        elif query == ADD:
            key, amount = request.key(), request.i64()
            total = int(self._data.get(key, b"0")) + amount
            self._set(key, str(total).encode())
            out += I64.pack(total)
        elif query == CHECK:
            keys = [request.key() for _ in range(request.count())]
            out += U8.pack(READY if all(self._exists(key) for key in keys) else NOT_READY)
        elif query == WAIT:
            keys = [request.key() for _ in range(request.count())]
            missing = {key for key in keys if not self._exists(key)}
            if missing:
                self._cancel_wait(conn)
                conn.awaiting = missing
                for key in missing:
                    self._waiters.setdefault(key, []).append(conn)
            else:
                out += U8.pack(STOP_WAITING)
        elif query == GETNUMKEYS:
            out += I64.pack(len(self._data))
        elif query == DELETE_KEY:
            out += I64.pack(1 if self._data.pop(request.key(), None) is not None else 0)
        elif query == APPEND:
            key, value = request.key(), request.value()
            self._set(key, self._data.get(key, b"") + value)
        elif query == MULTI_GET:
            keys = [request.key() for _ in range(request.count())]
            for key in keys:
                out += vector(self._data.get(key, b""))
        elif query == MULTI_SET:
            pairs = [(request.key(), request.value()) for _ in range(request.count())]
            for key, value in pairs:
                self._set(key, value)
        elif query == CANCEL_WAIT:
            self._cancel_wait(conn)
            out += U8.pack(WAIT_CANCELED)
        elif query == QUEUE_PUSH:
            key, value = request.key(), request.value()
            self._queues.setdefault(key, deque()).append(value)
            self._wake(key, one=True)
        elif query == QUEUE_POP:
            queue = self._queues.get(request.key())
            out += I64.pack(len(queue) if queue else 0)
            if queue:
                out += vector(queue.popleft())
        elif query == QUEUE_LEN:
            queue = self._queues.get(request.key())
            out += I64.pack(len(queue) if queue else 0)
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
                conn.outbox += U8.pack(STOP_WAITING)
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

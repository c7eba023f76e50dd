"""A client of the launch's recovery store (``store_server.py``) or of torch's own ``TCPStore``,
for the node supervisors, the standard library only (``store_protocol.py``: the requests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta

from ddp_hpc.engine.recovery.store_protocol import (
    ADD, APPEND, CANCEL_WAIT, CHECK, COMPARE_SET, DEFAULT_TIMEOUT, DELETE_KEY, GET, GETNUMKEYS, I64, KEY_PREFIX, MAGIC,
    MULTI_GET, MULTI_SET, PING, READY, SET, STOP_WAITING, U8, U32, U64, VALIDATE, WAIT, WAIT_CANCELED, StoreError,
    StoreTimeout, Value, vector)


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
        sock.sendall(U8.pack(VALIDATE) + U32.pack(MAGIC))
        return sock

    def close(self) -> None:
        self._sock.close()

    # -- the wire ------------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        return vector((KEY_PREFIX + key).encode())

    def _keys(self, keys: Sequence[str]) -> bytes:
        return U64.pack(len(keys)) + b"".join(self._key(key) for key in keys)

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
        return self._reply(U64.unpack(self._reply(8))[0])

    def _request(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise StoreError(f"the store at {self.host}:{self.port} is gone: {exc}") from exc

    def _wait(self, keys: Sequence[str], timeout_s: float) -> None:
        self._request(U8.pack(WAIT) + self._keys(keys))
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
        self._request(U8.pack(CANCEL_WAIT))
        if self._reply(1)[0] != WAIT_CANCELED:  # the keys came as it timed out
            self._reply(1)
        raise StoreTimeout(f"wait timeout after {timeout_s * 1000:.0f}ms, keys: {list(keys)}")

    # -- torch's Store methods -----------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        with self._lock:
            self._request(U8.pack(SET) + self._key(key) + vector(_encode(value)))

    def get(self, key: str) -> bytes:
        with self._lock:
            self._wait([key], self.timeout_s)
            self._request(U8.pack(GET) + self._key(key))
            return self._vector_reply()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._request(U8.pack(ADD) + self._key(key) + I64.pack(amount))
            return I64.unpack(self._reply(8))[0]

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        with self._lock:
            self._request(U8.pack(COMPARE_SET) + self._key(key) + vector(_encode(expected))
                          + vector(_encode(desired)))
            return self._vector_reply()

    def check(self, keys: Sequence[str]) -> bool:
        with self._lock:
            self._request(U8.pack(CHECK) + self._keys(keys))
            return self._reply(1)[0] == READY

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        with self._lock:
            self._wait(keys, _seconds(timeout, self.timeout_s))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._lock:
            self._wait(keys, self.timeout_s)
            self._request(U8.pack(MULTI_GET) + self._keys(keys))
            return [self._vector_reply() for _ in keys]

    def multi_set(self, keys: Sequence[str], values: Iterable[Value]) -> None:
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"multi_set: {len(keys)} keys, {len(values)} values")
        with self._lock:
            self._request(U8.pack(MULTI_SET) + U64.pack(len(keys))
                          + b"".join(self._key(key) + vector(_encode(value)) for key, value in zip(keys, values)))

    def append(self, key: str, value: Value) -> None:
        with self._lock:
            self._request(U8.pack(APPEND) + self._key(key) + vector(_encode(value)))

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._request(U8.pack(DELETE_KEY) + self._key(key))
            return I64.unpack(self._reply(8))[0] == 1

    def num_keys(self) -> int:
        with self._lock:
            self._request(U8.pack(GETNUMKEYS))
            return I64.unpack(self._reply(8))[0]

    def ping(self, nonce: int = 0) -> bool:
        with self._lock:
            self._request(U8.pack(PING) + U32.pack(nonce))
            return U32.unpack(self._reply(4))[0] == nonce

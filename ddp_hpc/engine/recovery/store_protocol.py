"""torch's ``TCPStore`` wire protocol, as the launch's torch-free store speaks it
(``store_server.py``, ``store_client.py``).

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
"""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Union

MAGIC = 0x3C85F7CE

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET, \
    CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN = range(17)
READY, NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1

U8, U32, U64, I64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q")
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


def vector(data: bytes) -> bytes:
    return U64.pack(len(data)) + data

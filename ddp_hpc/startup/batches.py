"""Store requests in batches of a bounded number of keys (torch-free: the launch reads its
ranks' keys in its recovery store with them too)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

#: Keys per store request at most: torch's TCPStore takes time quadratic in the keys of one
#: ``check`` or ``multi_get`` (18 s for 50,000 keys here, 2.4 us a key in requests of 256).
KEYS_PER_REQUEST = 256


def store_batches(keys: Sequence[str]) -> Iterator[list[str]]:
    """``keys`` in requests the store serves in linear time (``KEYS_PER_REQUEST`` each)."""
    for first in range(0, len(keys), KEYS_PER_REQUEST):
        yield list(keys[first:first + KEYS_PER_REQUEST])

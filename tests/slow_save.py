"""A ``torch.save`` that trickles a checkpoint out, as a slow file system writes it, so that
a write stays half done long enough to be seen (and killed) mid-way."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any


def trickling(save: Callable[[Any, Any], None], chunks: int, pause_s: float) -> Callable[[Any, Any], None]:
    """``save``'s bytes written to the handle in ``chunks`` flushed pieces, ``pause_s`` apart."""

    def trickle(obj: Any, handle: Any) -> None:
        buffer = io.BytesIO()
        save(obj, buffer)
        data = buffer.getvalue()
        size = len(data) // chunks + 1
        for start in range(0, len(data), size):
            handle.write(data[start:start + size])
            handle.flush()
            time.sleep(pause_s)

    return trickle

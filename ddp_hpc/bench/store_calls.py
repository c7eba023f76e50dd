"""A store wrapper that counts round trips: what the rendezvous' diagnosis costs at scale
(``benchmarks/gate_diagnosis.py``, and the test that bounds it)."""

from __future__ import annotations

from typing import Any


class CountingStore:
    """``store`` (a ``torch.distributed.Store``), counting its calls: each is one round trip."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)
        return counted

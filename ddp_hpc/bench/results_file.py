"""bench.json holds one top-level key per bench mode (the loops' sections, ``scale``,
``own_cpu``): each mode replaces its own keys and keeps the others' figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddp_hpc.contract import atomic_write


def merge_into(output: Path, sections: dict[str, Any]) -> None:
    """Write ``sections`` into ``output``'s top level, keeping every other key already there."""
    merged = json.loads(output.read_text()) if output.exists() else {}
    merged.update(sections)
    output.parent.mkdir(parents=True, exist_ok=True)
    # Not durable: a benchmark's figures can be measured again.
    atomic_write(output, json.dumps(merged, indent=2) + "\n", durable=False)

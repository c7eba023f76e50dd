"""Read the points of W&B's offline run files (``run-<id>.wandb``).

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version) and then
LevelDB's log format (32 KiB blocks; each chunk a 7-byte header: CRC, length, type) whose
records are W&B ``Record`` protobufs. A history record is one step's row.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> Iterator[bytes]:
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        if len(payload) < length or kind not in (_FULL, _FIRST, _MIDDLE, _LAST):
            return  # the end, or a record cut short by a kill
        pos += 7 + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            parts = payload
        elif kind == _MIDDLE:
            parts += payload
        else:
            yield parts + payload
            parts = b""


def history(path: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {metric: value}) of each history row in one offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    rows = []
    for raw in _records(data):
        record = pb.Record()
        try:
            record.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - a damaged tail record
            break
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                try:
                    row[key] = float(json.loads(item.value_json))
                except (TypeError, ValueError):
                    continue
        rows.append((record.history.step.num, row))
    return rows


def offline_run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """Every attempt's file of run ``run_id`` under ``<dir>/wandb``, oldest first."""
    return sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))

"""Host lists: SLURM's compressed node lists and PBS node files."""

from __future__ import annotations

import re
from pathlib import Path

from ddp_hpc.errors import UserError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise UserError(f"unbalanced '[' in node list {text!r}")
    parts.append(text[start:])
    return [p for p in (part.strip() for part in parts) if p]


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    """``"001-003,7"`` -> ``["001", "002", "003", "7"]``; zero padding is kept."""
    values = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise UserError(f"bad range {item!r} in node list {nodelist!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise UserError(f"descending range {item!r} in node list {nodelist!r}")
        width = len(low) if low.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def _expand_one(pattern: str, nodelist: str) -> list[str]:
    """Expand every bracket group of one host pattern (``rack[1-2]-n[01-02]``: 4 hosts)."""
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    head, body, tail = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    return [head + value + rest
            for value in _expand_ranges(body, nodelist)
            for rest in _expand_one(tail, nodelist)]


def expand_nodelist(nodelist: str) -> list[str]:
    """All hosts of a SLURM node list, in order: ``"n[001-002,7],login"`` -> 4 names."""
    hosts = [host for part in _split_top_level(nodelist) for host in _expand_one(part, nodelist)]
    if not hosts:
        raise UserError(f"empty node list {nodelist!r}")
    return hosts


def read_nodefile(path: str | Path) -> list[str]:
    """Hosts of a PBS node file, one line per rank slot, order kept, duplicates removed."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UserError(f"cannot read PBS_NODEFILE {path}: {exc.strerror}") from None
    hosts = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    if not hosts:
        raise UserError(f"PBS_NODEFILE {path} lists no hosts")
    return hosts


def with_suffix(host: str, suffix: str) -> str:
    """The name of ``host`` on another network: its short name + ``suffix``.

    Clusters such as Aurora route training traffic over a high-speed network whose host
    names add a suffix to the short name; the cluster profile supplies it.
    """
    if not suffix:
        return host
    short = host.split(".", 1)[0]
    return short if short.endswith(suffix) else short + suffix

"""bench.json holds one top-level key per bench mode (the loops' sections, ``scale``,
``own_cpu``): each mode replaces its own keys and keeps the others' figures.

A bench runs for minutes: :func:`check_output` refuses an output it could not read or
write before any work starts, and :func:`merge_into` never loses the figures at the end
(where the output cannot be written, they go to a file beside it or in the temporary
folder, named in the error)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddp_hpc.contract import atomic_write
from ddp_hpc.errors import UserError


def markdown_path(output: Path) -> Path:
    """Where the markdown tables go: ``bench.json`` -> ``bench.md``; a name with another
    suffix (``mktemp``'s ``tmp.XXXXXXXXXX``) keeps it: ``tmp.XXXXXXXXXX.md``."""
    return output.with_suffix(".md") if output.suffix == ".json" else output.with_name(output.name + ".md")


def _read(output: Path) -> dict[str, Any]:
    """The results already in ``output``; none when it is missing or empty (as ``mktemp`` leaves it)."""
    if not output.exists():
        return {}
    if output.is_dir():
        raise UserError(f"--output {output}: is a folder; give a file name (e.g. {output / 'bench.json'})")
    try:
        text = output.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--output {output}: cannot be read ({getattr(error, 'strerror', None) or error})") from None
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise UserError(f"--output {output}: holds something other than bench results (not a JSON object); "
                        f"move it away or give another file")
    return data


def check_output(output: Path) -> None:
    """Refuse, before any work, an output whose results could not be merged and written."""
    _read(output)
    folder = output.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"--output {output}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (output.exists() and not os.access(output, os.W_OK)):
        raise UserError(f"--output {output}: not writable here ({folder})")


def merge_into(output: Path, sections: dict[str, Any]) -> None:
    """Write ``sections`` into ``output``'s top level, keeping every other key already there."""
    try:
        merged = _read(output)
        merged.update(sections)
        output.parent.mkdir(parents=True, exist_ok=True)
        # Not durable: a benchmark's figures can be measured again.
        atomic_write(output, json.dumps(merged, indent=2) + "\n", durable=False)
    except (OSError, UserError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise UserError(f"could not write the results to {output} ({reason}); they are in {_rescue(sections)}") from None


def _rescue(sections: dict[str, Any]) -> str:
    """Keep measured figures whose output went away: a new file in the temporary folder, or stdout."""
    text = json.dumps(sections, indent=2) + "\n"
    try:
        handle, name = tempfile.mkstemp(prefix="ddp-hpc-bench-", suffix=".json")
        with open(handle, "w") as file:
            file.write(text)
        return name
    except OSError:
        sys.stdout.write(text)
        sys.stdout.flush()
        return "the JSON printed above"

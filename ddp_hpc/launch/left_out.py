"""The nodes a batch script left out of a restart, as ``ddp-hpc status`` shows them.

``ddp-hpc launch`` (over a hostfile, or in srun steps: where a batch script with
``--spare-nodes`` ends) appends one JSON line per node to ``RUN/left-out-hosts.jsonl`` when a
restart runs without it, with ``record_left_out``; so does a submitit command job's restart.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.contract import LEFT_OUT_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeftOutHost:
    host: str
    #: The attempt (0 = the first) in which a rank failed there.
    attempt: int
    reason: str

    def describe(self) -> str:
        return f"{self.host} (attempt {self.attempt}: {self.reason or 'a rank failed there'})"


def record_left_out(run_folder: Path, host: LeftOutHost) -> None:
    """Append ``host``: one JSON line, in one write."""
    line = json.dumps({"host": host.host, "attempt": host.attempt, "reason": host.reason}) + "\n"
    with open(run_folder / LEFT_OUT_FILE, "a") as handle:
        handle.write(line)


def leave_out(run_folder: Path, excluded: list[str], host: LeftOutHost) -> None:
    """A launch's restart runs without ``host`` (where its attempt's first rank failed): added
    to the hosts it ``excluded``, recorded and said, once."""
    if host.host in excluded:
        return
    excluded.append(host.host)
    record_left_out(run_folder, host)
    log.warning("leaving out node(s) %s, where a rank failed (%s)", ",".join(excluded), host.reason)


def read_left_out(run_folder: Path) -> list[LeftOutHost]:
    """Every left-out node recorded in ``run_folder``; lines that do not parse are skipped."""
    try:
        text = (run_folder / LEFT_OUT_FILE).read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            data = json.loads(line)
            found.append(LeftOutHost(str(data["host"]), int(data["attempt"]), str(data.get("reason", ""))))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def left_out_line(run_folder: Path) -> str | None:
    """``left out: n1 (attempt 0: rank 1 exited with status 137)``, or None."""
    hosts = read_left_out(run_folder)
    return f"left out: {'; '.join(host.describe() for host in hosts)}" if hosts else None

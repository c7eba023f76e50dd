"""Which collective each rank is at, from torch's flight recorder, and who is out of step.

A hang in a collective is most often a rank that skipped one (a collective under a
condition only some ranks meet) or is stuck before one: every rank then waits at a
different place of the same sequence. torch numbers the collectives of a process group
and, with ``TORCH_FR_BUFFER_SIZE`` set before the group starts, keeps the last ones (op,
sizes, whether finished) in its flight recorder, for gloo as for NCCL. Each rank's
heartbeat publishes its newest entry (``position()``); the rank whose watchdog fires
reads every rank's and ``out_of_step`` says who differs from the rest::

    rank 1 (host h2) is at collective #6 (barrier); every other rank is at collective #6
    (all_reduce, 4.0 KiB)
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

#: torch's flight recorder size (entries per process); read when the first group starts.
FR_BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
#: Enough entries for the newest collective and a few before it: a dump's cost grows with
#: the entries (about 40 us each with gloo: benchmarks/flight_recorder_cost.py).
FR_BUFFER_DEFAULT = "16"
#: The default process group's name in flight-recorder entries.
_DEFAULT_GROUP = "0"


def flight_recorder_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """What to export so that torch records collectives: nothing when the user set it."""
    if environ.get(FR_BUFFER_VAR, "").strip() or environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "").strip():
        return {}
    return {FR_BUFFER_VAR: FR_BUFFER_DEFAULT}


def enable_flight_recorder(environ: MutableMapping[str, str]) -> None:
    """For the process that is about to start its process group (the CLI's ``train``)."""
    environ.update(flight_recorder_variables(environ))


@dataclass(frozen=True)
class CollectivePosition:
    """A rank's newest collective of the default group: sequence number, op, bytes sent
    in, and whether it finished (then the rank is in its own code after it)."""

    seq: int
    op: str
    nbytes: int
    done: bool

    def describe(self) -> str:
        what = f"{self.op}, {human_bytes(self.nbytes)}" if self.nbytes else self.op
        return f"{'past' if self.done else 'at'} collective #{self.seq} ({what})"

    def to_text(self) -> str:
        return f"{self.seq}|{self.op}|{self.nbytes}|{int(self.done)}"

    @classmethod
    def from_text(cls, text: str) -> CollectivePosition | None:
        parts = text.split("|")
        if len(parts) != 4 or not (parts[0].isdigit() and parts[2].isdigit()):
            return None
        return cls(int(parts[0]), parts[1], int(parts[2]), parts[3] == "1")


def human_bytes(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _itemsize(dtype_name: str) -> int:
    """torch's dtype names in flight-recorder entries ("Float", "BFloat16", "Long")."""
    import torch

    dtype = getattr(torch, dtype_name.lower(), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0


def entry_position(entry: Mapping[str, object]) -> CollectivePosition:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    nbytes = sum(math.prod(size) * _itemsize(dtype) for size, dtype in zip(sizes, dtypes))  # type: ignore[arg-type]
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    return CollectivePosition(int(entry["collective_seq_id"]), op, int(nbytes),  # type: ignore[call-overload]
                              bool(entry.get("retired")))


def position() -> CollectivePosition | None:
    """This process's newest collective of the default group, or None when torch keeps no
    flight record (``TORCH_FR_BUFFER_SIZE`` unset when the group started, an older torch)."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    trace = pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=False))
    entries = [entry for entry in trace.get("entries", ())
               if not entry.get("is_p2p") and str(entry.get("process_group", ("",))[0]) == _DEFAULT_GROUP]
    return entry_position(max(entries, key=lambda e: e["record_id"])) if entries else None


def _ranks(ranks: list[int], hosts: Mapping[int, str]) -> str:
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(hosts.get(rank, "?"), []).append(rank)
    return "; ".join(f"rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))} (host {host})"
                     for host, members in by_host.items())


def out_of_step(positions: Mapping[int, CollectivePosition | None], hosts: Mapping[int, str]) -> str:
    """One sentence naming the ranks whose collective differs from the most common one.

    Ties go to the ranks furthest along: the ones behind are named (with two ranks at
    the same number but different ops, rank 0's side counts as the common one).
    """
    known = {rank: pos for rank, pos in positions.items() if pos is not None}
    unknown = sorted(set(positions) - set(known))
    if not known:
        return (f"no rank has a flight record of its collectives: set {FR_BUFFER_VAR}={FR_BUFFER_DEFAULT} before "
                "the process group starts (ddp-hpc run and ddp-hpc train do) to see where each rank waits")
    groups: dict[CollectivePosition, list[int]] = {}
    for rank in sorted(known):
        groups.setdefault(known[rank], []).append(rank)
    common = max(groups, key=lambda pos: (len(groups[pos]), pos.seq, -min(groups[pos])))
    tail = f" (no flight record from {_ranks(unknown, hosts)})" if unknown else ""
    if len(groups) == 1:
        return f"every rank is {common.describe()}: none is out of step{tail}"
    others = sorted((pos for pos in groups if pos != common), key=lambda pos: (pos.seq, min(groups[pos])))
    named = "; ".join(f"{_ranks(groups[pos], hosts)} {'is' if len(groups[pos]) == 1 else 'are'} {pos.describe()}"
                      for pos in others)
    return f"out of step: {named}; every other rank is {common.describe()}{tail}"

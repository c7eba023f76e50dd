"""The rendezvous port every rank of a job agrees on without talking to each other."""

from __future__ import annotations

import re
import socket
import zlib
from dataclasses import dataclass

from ddp_hpc.errors import UserError


@dataclass(frozen=True)
class PortRange:
    """Ports a job id may map to. Below Linux's ephemeral range (32768+) by default, so a
    derived port is not taken by some client's outgoing connection."""

    low: int = 20000
    high: int = 29999

    def __post_init__(self) -> None:
        if not 1024 <= self.low <= self.high <= 65535:
            raise UserError(f"port range {self.low}-{self.high} must lie within 1024-65535")

    @property
    def span(self) -> int:
        return self.high - self.low + 1


_LEADING_INT = re.compile(r"^(\d+)")


def derive_port(key: str, port_range: PortRange = PortRange()) -> int:
    """A port in ``port_range`` that is a pure function of ``key``.

    Keys that start with a job number (``"4242"``, ``"4242.pbs01"``, ``"4242|step0"``) map
    consecutive job numbers to consecutive ports, so neighbouring jobs on one node never
    share one; the rest of the key is hashed in.
    """
    match = _LEADING_INT.match(key)
    number = int(match.group(1)) if match else 0
    rest = key[match.end():] if match else key
    return port_range.low + (number + zlib.crc32(rest.encode())) % port_range.span


def parse_port(raw: str, name: str = "MASTER_PORT") -> int:
    try:
        port = int(raw.strip())
    except ValueError:
        raise UserError(f"{name}={raw!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise UserError(f"{name}={port} is out of range: use 1-65535")
    return port


def free_port() -> int:
    """A port that is free on the loopback interface right now (single-process use only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

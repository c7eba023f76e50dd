"""Sweeps: the cartesian product of ``--sweep KEY=V1,V2,...`` axes, run as one array job.

Each element gets its own overrides (config jobs) or environment variables (command jobs:
``DDP_HPC_SWEEP_INDEX`` and ``DDP_HPC_SWEEP_<KEY>``) and its own run folder.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ddp_hpc.config_loader import ConfigError
from ddp_hpc.contract import SWEEP_INDEX_VAR, SWEEP_VAR_PREFIX

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


@dataclass(frozen=True)
class SweepAxis:
    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class SweepElement:
    index: int
    #: ``(key, value)`` pairs, one per axis.
    assignments: tuple[tuple[str, str], ...]

    @property
    def overrides(self) -> tuple[str, ...]:
        return tuple(f"{key}={value}" for key, value in self.assignments)

    def environment(self) -> dict[str, str]:
        env = {SWEEP_INDEX_VAR: str(self.index)}
        for key, value in self.assignments:
            env[SWEEP_VAR_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", key).upper()] = value
        return env

    def describe(self) -> str:
        return " ".join(self.overrides)


@dataclass(frozen=True)
class Sweep:
    axes: tuple[SweepAxis, ...]
    #: At most this many elements run at once (``%`` of an array job); None: no limit.
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--sweep-limit {self.limit} must be >= 1")
        keys = [axis.key for axis in self.axes]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"--sweep names a key twice: {', '.join(keys)}")

    @classmethod
    def parse(cls, specs: Sequence[str], limit: int | None = None) -> Sweep | None:
        """``["training.lr=0.001,0.003", "training.batch_size=32,64"]`` -> a Sweep (None if empty)."""
        axes = []
        for spec in specs:
            key, sep, values = spec.partition("=")
            key = key.strip()
            if not sep or not _KEY.match(key):
                raise ConfigError(f"--sweep {spec!r}: use KEY=V1,V2,... (e.g. training.lr=0.001,0.003)")
            parsed = tuple(v.strip() for v in values.split(","))
            if not values.strip() or any(not v for v in parsed):
                raise ConfigError(f"--sweep {spec!r}: empty value; use KEY=V1,V2,...")
            axes.append(SweepAxis(key, parsed))
        return cls(tuple(axes), limit) if axes else None

    def elements(self) -> list[SweepElement]:
        product = itertools.product(*([(axis.key, value) for value in axis.values] for axis in self.axes))
        return [SweepElement(index, tuple(assignments)) for index, assignments in enumerate(product)]

    def array_spec(self) -> str:
        """``0-N[%LIMIT]``: SLURM's ``--array`` and PBS Pro's ``-J`` take the same form."""
        last = len(self.elements()) - 1
        return f"0-{last}" + (f"%{self.limit}" if self.limit else "")

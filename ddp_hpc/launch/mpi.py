"""``mpiexec`` command lines, as argument lists: the launch's (``local.MpiexecHere``,
``hosts.HostfileAttempts``), a PBS script's per-node lines and the benchmarks'.

What differs between the MPI flavours (their program names, their options, whether their
status may lose a stop) is each flavour's launcher's (``launch/launchers/openmpi.py``,
``mpich.py``, ``pals.py``: an ``MpiFlavour``), found by name in the launcher registry, so a
site's package may add one (docs/architecture.md)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ddp_hpc.errors import UserError
from ddp_hpc.launch import registry


class MpiFlavour(Protocol):
    """An mpiexec launcher's facts (``launchers/mpiexec.py``'s ``MpiexecLauncher``)."""

    name: str
    #: Program names tried in order (Debian installs both MPIs side by side: plain
    #: ``mpiexec`` is Open MPI's there, MPICH's is ``mpiexec.mpich``/``mpiexec.hydra``).
    programs: tuple[str, ...]
    #: How to install it, where none of ``programs`` is found.
    install_hint: str
    #: Whether its exit status may lose the ranks' 75 once it passed a stop on: its ranks run
    #: under the wrapper that touches the preempted marker (``script.RANK_FAILURE_WRAPPER``)
    #: wherever the launch has a run folder.
    loses_stop_status: bool
    #: Whether it takes ``--cpu-bind`` and ``--depth`` (Cray PALS's binding options).
    binds: bool

    def mpiexec_args(self, launch: MpiLaunch, program: str) -> list[str]:
        """The line up to the command: ``program`` and its options for ``launch``."""


def mpi_flavour(name: str) -> MpiFlavour:
    """The MPI flavour called ``name`` (an mpiexec launcher)."""
    found = registry.launchers().get(name)
    if not hasattr(found, "mpiexec_args"):
        raise UserError(f"unknown MPI flavour {name!r}: choose one of {', '.join(mpi_programs())}")
    return found  # type: ignore[return-value]


def mpi_programs() -> dict[str, tuple[str, ...]]:
    """Each MPI flavour's program names, by flavour."""
    return {name: launcher.programs for name, launcher in registry.launchers().items()
            if hasattr(launcher, "mpiexec_args")}


@dataclass(frozen=True)
class MpiLaunch:
    """What to start: ``ranks_per_node`` ranks on each of ``nodes`` hosts."""

    flavour: str
    nodes: int
    ranks_per_node: int
    command: Sequence[str]
    hostfile: str | None = None
    #: Variables every rank must see (exported to remote hosts too).
    export: Mapping[str, str] = field(default_factory=dict)
    #: Variables passed on by name from mpiexec's environment to remote hosts (Open MPI's
    #: ``-x NAME``; MPICH and PALS pass the whole environment anyway).
    forward: tuple[str, ...] = ()
    #: Allow more ranks than cores (local runs; Open MPI refuses them otherwise).
    oversubscribe: bool = False
    #: Cray PALS only: ``--cpu-bind`` value and ``--depth`` (cores per rank).
    cpu_bind: str | None = None
    depth: int | None = None
    #: Open MPI only: pass --allow-run-as-root (local launches as root).
    allow_root: bool = False

    def __post_init__(self) -> None:
        mpi_flavour(self.flavour)
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise UserError(f"nodes ({self.nodes}) and ranks per node ({self.ranks_per_node}) must be >= 1")
        if not self.command:
            raise UserError("no command to launch: give it after '--'")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def find_program(flavour: str, path: str | None = None) -> str:
    mpi = mpi_flavour(flavour)
    for name in mpi.programs:
        found = shutil.which(name, path=path)
        if found:
            return name
    raise UserError(f"no {flavour} mpiexec found on PATH (tried {', '.join(mpi.programs)}): {mpi.install_hint}")


def build_mpiexec(launch: MpiLaunch, program: str | None = None) -> list[str]:
    """The full argument list; ``program`` defaults to the flavour's first installed name.

    Scripts pass shell variables (``ShellVar``) for the program and host file, resolved
    on the cluster at run time.
    """
    program = program or find_program(launch.flavour)
    return mpi_flavour(launch.flavour).mpiexec_args(launch, program) + list(launch.command)

"""``mpiexec`` command lines, one builder per MPI flavour, as argument lists."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ddp_hpc.errors import UserError

#: Program names tried in order for each flavour (Debian installs both MPIs side by side:
#: plain ``mpiexec`` is Open MPI's there, MPICH's is ``mpiexec.mpich``/``mpiexec.hydra``).
PROGRAMS: dict[str, tuple[str, ...]] = {
    "openmpi": ("mpiexec.openmpi", "mpirun.openmpi", "mpiexec"),
    "mpich": ("mpiexec.mpich", "mpiexec.hydra", "mpiexec"),
    "pals": ("mpiexec",),
}
#: Launchers whose exit status may lose the ranks' 75 once they passed a stop on (Hydra
#: reports it as 0 about one time in six): their ranks run under the wrapper that touches
#: the preempted marker (``script.RANK_FAILURE_WRAPPER``) wherever the launch has a run folder.
STOP_STATUS_LOST = frozenset({"mpich"})
INSTALL_HINTS = {
    "openmpi": "apt-get install openmpi-bin",
    "mpich": "apt-get install mpich",
    "pals": "load the site's cray-pals module",
}


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
        if self.flavour not in PROGRAMS:
            raise UserError(f"unknown MPI flavour {self.flavour!r}: choose one of {', '.join(PROGRAMS)}")
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise UserError(f"nodes ({self.nodes}) and ranks per node ({self.ranks_per_node}) must be >= 1")
        if not self.command:
            raise UserError("no command to launch: give it after '--'")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def find_program(flavour: str, path: str | None = None) -> str:
    for name in PROGRAMS[flavour]:
        found = shutil.which(name, path=path)
        if found:
            return name
    raise UserError(f"no {flavour} mpiexec found on PATH (tried {', '.join(PROGRAMS[flavour])}): "
                    f"{INSTALL_HINTS[flavour]}")


def build_mpiexec(launch: MpiLaunch, program: str | None = None) -> list[str]:
    """The full argument list; ``program`` defaults to the flavour's first installed name.

    Scripts pass shell variables (``ShellVar``) for the program and host file, resolved
    on the cluster at run time.
    """
    program = program or find_program(launch.flavour)
    n, ppn = str(launch.world_size), str(launch.ranks_per_node)
    if launch.flavour == "openmpi":
        args = [program, "-n", n, "--map-by", f"ppr:{ppn}:node", "--bind-to", "none"]
        if launch.hostfile:
            args += ["--hostfile", launch.hostfile]
        if launch.oversubscribe:
            args.append("--oversubscribe")
        if launch.allow_root:
            args.append("--allow-run-as-root")
        for name, value in launch.export.items():
            args += ["-x", f"{name}={value}"]
        for name in launch.forward:
            args += ["-x", name]
    elif launch.flavour == "pals":
        args = [program, "-n", n, "-ppn", ppn]
        if launch.depth:
            args += ["--depth", str(launch.depth)]
        if launch.cpu_bind:
            args += ["--cpu-bind", launch.cpu_bind]
        if launch.hostfile:
            args += ["--hostfile", launch.hostfile]
        args.append("--envall")
        for name, value in launch.export.items():
            args += ["--env", f"{name}={value}"]
    else:  # mpich / hydra (and Intel MPI): -genvall passes the whole environment
        args = [program, "-n", n, "-ppn", ppn]
        if launch.hostfile:
            args += ["-f", launch.hostfile]
        args.append("-genvall")
        for name, value in launch.export.items():
            args += ["-genv", name, value]
    return args + list(launch.command)

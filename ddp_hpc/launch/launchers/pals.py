"""``--launcher pals``: Cray PALS's mpiexec (mpiexec.py), over the hosts of ``--hostfile`` only
(a PBS job's nodes), with its ``--cpu-bind`` and ``--depth``. The stop: SIGUSR2, as before
(Cray's aprun documents passing both on; there is no PALS on the test machine)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ddp_hpc.errors import UserError
from ddp_hpc.launch.launchers.mpiexec import MpiexecLauncher
from ddp_hpc.launch.mpi import MpiLaunch

if TYPE_CHECKING:
    from ddp_hpc.launch.spec import LaunchSpec


@dataclass(frozen=True)
class PalsLauncher(MpiexecLauncher):
    name: ClassVar[str] = "pals"
    listed_at: ClassVar[int] = 40
    passes_on: ClassVar[signal.Signals] = signal.SIGUSR2
    binds: ClassVar[bool] = True
    programs: ClassVar[tuple[str, ...]] = ("mpiexec",)
    install_hint: ClassVar[str] = "load the site's cray-pals module"

    def check_here(self, spec: LaunchSpec) -> None:
        raise UserError("--launcher pals starts ranks over the hosts of a --hostfile (a PBS job's nodes): give "
                        "--hostfile FILE")

    def mpiexec_args(self, launch: MpiLaunch, program: str) -> list[str]:
        args = [program, "-n", str(launch.world_size), "-ppn", str(launch.ranks_per_node)]
        if launch.depth:
            args += ["--depth", str(launch.depth)]
        if launch.cpu_bind:
            args += ["--cpu-bind", launch.cpu_bind]
        if launch.hostfile:
            args += ["--hostfile", launch.hostfile]
        args.append("--envall")
        for name, value in launch.export.items():
            args += ["--env", f"{name}={value}"]
        return args

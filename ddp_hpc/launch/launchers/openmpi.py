"""``--launcher openmpi``: Open MPI's mpiexec (mpiexec.py), which passes SIGUSR2 on."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import ClassVar

from ddp_hpc.launch.launchers.mpiexec import MpiexecLauncher
from ddp_hpc.launch.mpi import MpiLaunch


@dataclass(frozen=True)
class OpenMpiLauncher(MpiexecLauncher):
    name: ClassVar[str] = "openmpi"
    listed_at: ClassVar[int] = 20
    passes_on: ClassVar[signal.Signals] = signal.SIGUSR2
    programs: ClassVar[tuple[str, ...]] = ("mpiexec.openmpi", "mpirun.openmpi", "mpiexec")
    install_hint: ClassVar[str] = "apt-get install openmpi-bin"

    def mpiexec_args(self, launch: MpiLaunch, program: str) -> list[str]:
        """Ranks placed ``ppr:N:node``, unbound; each variable exported or forwarded by name
        (``-x``: Open MPI passes no other variable to another host)."""
        args = [program, "-n", str(launch.world_size), "--map-by", f"ppr:{launch.ranks_per_node}:node",
                "--bind-to", "none"]
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
        return args

"""``--launcher mpich``: MPICH's Hydra mpiexec (mpiexec.py). Hydra ends the job on SIGUSR2
and passes SIGTERM on; its status may lose the ranks' 75 after a stop (``loses_stop_status``: the
ranks run under the wrapper that touches the preempted marker)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import ClassVar

from ddp_hpc.launch.launchers.mpiexec import MpiexecLauncher
from ddp_hpc.launch.mpi import MpiLaunch


@dataclass(frozen=True)
class MpichLauncher(MpiexecLauncher):
    name: ClassVar[str] = "mpich"
    listed_at: ClassVar[int] = 30
    passes_on: ClassVar[signal.Signals] = signal.SIGTERM
    programs: ClassVar[tuple[str, ...]] = ("mpiexec.mpich", "mpiexec.hydra", "mpiexec")
    install_hint: ClassVar[str] = "apt-get install mpich"
    loses_stop_status: ClassVar[bool] = True  # Hydra reports the ranks' 75 as 0 about one time in six

    def mpiexec_args(self, launch: MpiLaunch, program: str) -> list[str]:
        """Hydra (and Intel MPI's): ``-genvall`` passes the whole environment."""
        args = [program, "-n", str(launch.world_size), "-ppn", str(launch.ranks_per_node)]
        if launch.hostfile:
            args += ["-f", launch.hostfile]
        args.append("-genvall")
        for name, value in launch.export.items():
            args += ["-genv", name, value]
        return args

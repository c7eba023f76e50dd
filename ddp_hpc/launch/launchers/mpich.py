"""``--launcher mpich``: MPICH's Hydra mpiexec (mpiexec.py). Hydra ends the job on SIGUSR2
and passes SIGTERM on; its status may lose the ranks' 75 after a stop (``mpi.STOP_STATUS_LOST``:
the ranks run under the wrapper that touches the preempted marker)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import ClassVar

from ddp_hpc.launch.launchers.mpiexec import MpiexecLauncher


@dataclass(frozen=True)
class MpichLauncher(MpiexecLauncher):
    name: ClassVar[str] = "mpich"
    listed_at: ClassVar[int] = 30
    summary: ClassVar[str] = "MPICH's (Hydra's) mpiexec starts the ranks (on this machine, or over --hostfile)"
    passes_on: ClassVar[signal.Signals] = signal.SIGTERM

"""``--launcher openmpi``: Open MPI's mpiexec (mpiexec.py), which passes SIGUSR2 on."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import ClassVar

from ddp_hpc.launch.launchers.mpiexec import MpiexecLauncher


@dataclass(frozen=True)
class OpenMpiLauncher(MpiexecLauncher):
    name: ClassVar[str] = "openmpi"
    listed_at: ClassVar[int] = 20
    summary: ClassVar[str] = "Open MPI's mpiexec starts the ranks (on this machine, or over --hostfile)"
    passes_on: ClassVar[signal.Signals] = signal.SIGUSR2

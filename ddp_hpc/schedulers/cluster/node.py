"""What the node itself says, where the probe runs on a compute node (inside a job): its GPUs
(device files, no torch), its network interfaces and the default route's; and which launcher
the PATH holds (srun, or mpiexec and its flavour)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.device import NVIDIA_TRACES
from ddp_hpc.environment.jobs import current_job
from ddp_hpc.schedulers.facts import Runner

#: Interface names that are, by every site's convention, a high-speed network (Slingshot, InfiniBand).
FAST_INTERFACE = re.compile(r"^(hsn|ib)\d+$")


@dataclass(frozen=True)
class NodeFacts:
    nvidia_gpus: int  # /dev/nvidiaN files
    amd_gpus: int  # /sys/class/kfd/kfd/topology/nodes with a GPU (ROCm), 0 without /dev/kfd
    interfaces: tuple[str, ...]
    default_route: str | None

    @property
    def fast_interface(self) -> str | None:
        """A high-speed interface that is not the default route's: gloo and NCCL need it named."""
        fast = [i for i in self.interfaces if FAST_INTERFACE.match(i)]
        if not fast or self.default_route in fast:
            return None
        return fast[0]


def in_job(environ: Mapping[str, str]) -> bool:
    return current_job(environ) is not None


def read_node(root: Path = Path("/")) -> NodeFacts:
    nvidia = len(list(root.glob(NVIDIA_TRACES[0])))
    amd = 0
    if (root / "dev/kfd").exists():
        for props in root.glob("sys/class/kfd/kfd/topology/nodes/*/properties"):
            if re.search(r"^simd_count\s+[1-9]", props.read_text(), re.MULTILINE):
                amd += 1  # a CPU node of the topology has no SIMDs
    net = root / "sys/class/net"
    interfaces = tuple(sorted(p.name for p in net.iterdir() if p.name != "lo")) if net.is_dir() else ()
    return NodeFacts(nvidia, amd, interfaces, default_route(root))


def default_route(root: Path = Path("/")) -> str | None:
    try:
        lines = (root / "proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    return next((f[0] for f in (line.split() for line in lines) if len(f) > 2 and f[1] == "00000000"), None)


@dataclass(frozen=True)
class LauncherFound:
    launcher: str | None  # a profile's launcher name; None where none is on PATH
    how: str  # what was found, for the profile's comment


def find_launcher(family: str, runner: Runner, which: Callable[[str], str | None] = shutil.which) -> LauncherFound:
    """srun under SLURM; under PBS the mpiexec on PATH and its flavour, from its --version."""
    if family == "slurm":
        path = which("srun")
        return LauncherFound("srun" if path else None, f"srun at {path}" if path else "no srun on PATH")
    for name, flavour in (("mpiexec.mpich", "mpich"), ("mpiexec.hydra", "mpich"), ("mpiexec.openmpi", "openmpi")):
        path = which(name)
        if path:  # Debian's names for each MPI installed side by side
            return LauncherFound(flavour, f"{name} at {path}")
    path = which("mpiexec")
    if path is None:
        return LauncherFound(None, "no mpiexec on PATH")
    return LauncherFound(*mpiexec_flavour(path, runner([path, "--version"]) or ""))


def mpiexec_flavour(path: str, version: str) -> tuple[str | None, str]:
    if os.path.realpath(path).endswith(".slurm"):  # Slurm's own wrapper (slurm-wlm-torque): srun, no MPI
        return None, f"{path} is Slurm's mpiexec wrapper (mpiexec.slurm), not an MPI"
    if "pals" in path.lower() or "PALS" in version:
        return "pals", f"Cray PALS mpiexec at {path}"
    if "Open MPI" in version or "OpenRTE" in version:
        return "openmpi", f"Open MPI mpiexec at {path}"
    if "HYDRA" in version or "MPICH" in version:
        return "mpich", f"MPICH (Hydra) mpiexec at {path}"
    return None, f"mpiexec at {path}, flavour not recognised from its --version"

"""What the node itself says, where the probe runs on a compute node (inside a job): its GPUs
(device files, no torch), its network interfaces and the default route's; and which MPI the
PATH holds (``find_mpiexec``: mpiexec and its flavour)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.device import NVIDIA_TRACES
from ddp_hpc.environment.jobs import current_job
from ddp_hpc.schedulers.facts import LauncherFound, Runner, Which

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


#: Debian's names for each MPI installed side by side, and their flavour.
SIDE_BY_SIDE = (("mpiexec.mpich", "mpich"), ("mpiexec.hydra", "mpich"), ("mpiexec.openmpi", "openmpi"))


def find_mpiexec(runner: Runner, which: Which = shutil.which, flavour: str | None = None) -> LauncherFound:
    """The MPI on PATH and its flavour: Debian's side-by-side names first (``flavour``'s
    before the others, where one is asked for), then ``mpiexec`` and its ``--version``."""
    names = sorted(SIDE_BY_SIDE, key=lambda pair: pair[1] != flavour)
    for name, found in names:
        path = which(name)
        if path:
            return LauncherFound(found, f"{name} at {path}")
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

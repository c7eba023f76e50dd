"""Cluster profiles: where a job runs, as YAML data (shipped in ``ddp_hpc/clusters/*.yaml``).

A profile names the scheduler, the launcher flavour, ranks and devices per node, the
device/backend, CPU binding, queue and file systems, setup lines and environment presets.
Users add a cluster by writing one file (in ``./configs/clusters`` or
``$DDP_HPC_CLUSTERS_DIR``); ``--cluster`` takes a name or a path.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from ddp_hpc.config import read_yaml
from ddp_hpc.config_loader import ConfigError, build, positive
from ddp_hpc.contract import CLUSTERS_DIR_VAR

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ClusterProfile:
    #: The scheduler family (``pbs``, ``slurm``, ``local``: a key of ``schedulers.REGISTRY``).
    #: Its backend checks the profile when it renders: which launchers run under it, too.
    scheduler: str
    launcher: Literal["pals", "mpich", "openmpi", "srun", "torchrun"]
    ranks_per_node: int
    devices_per_node: int = 0
    device: Literal["auto", "xpu", "cuda", "cpu"] = "auto"
    backend: Literal["auto", "nccl", "xccl", "ccl", "gloo"] = "auto"
    #: PALS ``--cpu-bind`` value (``list:...`` on Aurora, ``depth`` on Polaris).
    cpu_bind: str | None = None
    #: PALS ``--depth`` (cores per rank).
    depth: int | None = None
    cpus_per_task: int | None = None
    queue: str | None = None
    account: str | None = None
    filesystems: str | None = None
    #: PBS ``select=N:system=...``.
    system: str | None = None
    #: PBS ``-l place=...``.
    place: str | None = None
    host_suffix: str = ""
    setup: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        positive(self.ranks_per_node, "ranks_per_node")
        if self.devices_per_node < 0:
            raise ConfigError(f"devices_per_node must be >= 0, got {self.devices_per_node}")
        for name, value in self.env.items():
            if not _ENV_NAME.match(str(name)):
                raise ConfigError(f"env: {name!r} is not a valid environment variable name")
            if not isinstance(value, str):
                raise ConfigError(f"env.{name}: expected a string (quote it in YAML), got {value!r}")
        for line in self.setup:
            check_single_line(line, "setup line")

    @property
    def uses_gpus(self) -> bool:
        return self.device in ("cuda", "xpu")

    def check_ranks_per_node(self, ranks_per_node: int) -> None:
        """Ranks per node must fit the node's devices on GPU profiles."""
        positive(ranks_per_node, "ranks per node")
        if self.uses_gpus and self.devices_per_node and ranks_per_node > self.devices_per_node:
            raise ConfigError(f"{ranks_per_node} ranks per node but cluster {self.name!r} has "
                              f"{self.devices_per_node} {self.device} devices per node: use at most "
                              f"{self.devices_per_node}")


def check_single_line(text: str, what: str) -> str:
    if "\n" in text or "\r" in text or "\0" in text:
        raise ConfigError(f"{what} {text!r} must be a single line")
    return text


def profile_dirs() -> list[Path]:
    """Where profiles are looked up by name, first match wins: ``$DDP_HPC_CLUSTERS_DIR``,
    ``./configs/clusters``, then the profiles shipped inside the package (package data,
    so a non-editable install finds them too)."""
    dirs = [Path(os.environ[CLUSTERS_DIR_VAR])] if os.environ.get(CLUSTERS_DIR_VAR) else []
    dirs.append(Path.cwd() / "configs" / "clusters")
    dirs.append(Path(str(resources.files("ddp_hpc") / "clusters")))
    return dirs


def available_profiles() -> list[str]:
    names = {p.stem for d in profile_dirs() if d.is_dir() for p in d.glob("*.yaml")}
    return sorted(names)


def load_profile(name_or_path: str) -> ClusterProfile:
    """A profile by name (``aurora``) or by path (``my-cluster.yaml``)."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = next((d / f"{name_or_path}.yaml" for d in profile_dirs() if (d / f"{name_or_path}.yaml").exists()),
                    None)
        if path is None:
            raise ConfigError(f"unknown cluster profile {name_or_path!r}: choose one of "
                              f"{', '.join(available_profiles())}, or give the path of a YAML file")
    data = read_yaml(path)
    try:
        profile = build(ClusterProfile, data, path="")
    except ConfigError as exc:
        raise ConfigError(f"cluster profile {path}: {exc}") from None
    except TypeError as exc:  # a required key is missing
        raise ConfigError(f"cluster profile {path}: {str(exc).split('() ', 1)[-1]}") from None
    return replace(profile, name=profile.name or path.stem)

"""Cluster profiles: where a job runs, as YAML data (shipped in ``ddp_hpc/clusters/*.yaml``).

A profile names the scheduler, the launcher flavour, ranks and devices per node, the
device/backend, CPU binding, queue and file systems, setup lines and environment presets.
Users add a cluster by writing one file (in ``./configs/clusters`` or
``$DDP_HPC_CLUSTERS_DIR``), or by ``ddp-hpc cluster probe``; ``--cluster`` takes a name or a
path. Without ``--cluster``, the profile whose ``match`` fits this machine (the scheduler's
cluster name, or a host name pattern) is used: ``find_profile``.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from importlib import resources
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from ddp_hpc.config import read_yaml
from ddp_hpc.config_loader import ConfigError, build, positive
from ddp_hpc.contract import CLUSTERS_DIR_VAR

log = logging.getLogger(__name__)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: A local profile's launcher before ``ddp-hpc launch --launcher local`` took that name.
OLD_LOCAL_LAUNCHER = "torchrun"


@dataclass(frozen=True)
class ProfileMatch:
    """Which machines a profile is for, without ``--cluster``: either fits."""
    #: The scheduler's name for its cluster (SLURM's ``ClusterName``, a PBS server's name).
    cluster_name: str | None = None
    #: A shell pattern for this host's name, e.g. ``login*.frontier.olcf.ornl.gov``.
    hostname: str | None = None

    def __post_init__(self) -> None:
        if not (self.cluster_name or self.hostname):
            raise ConfigError("match: give cluster_name, hostname or both")


@dataclass(frozen=True)
class Machine:
    """This machine as a profile's ``match`` sees it."""
    cluster_names: tuple[str, ...]  # what the schedulers here call their cluster
    hostname: str
    #: The family whose commands answered here (its profiles come first), None where none did.
    scheduler: str | None = None


@dataclass(frozen=True)
class ClusterProfile:
    #: The scheduler family (``pbs``, ``slurm``, ``local``, or a site's: one of
    #: ``schedulers.registry.families()``, checked when a request is rendered). Its backend
    #: checks the profile when it renders: which launchers run under it, too.
    scheduler: str
    #: How the ranks start, honoured by the family's script: ``local`` (this machine), ``srun``
    #: or ``torchrun`` (one per node, started by srun) under SLURM, ``pals``, ``mpich`` or
    #: ``openmpi`` under PBS. A local profile's old word ``torchrun`` reads as ``local``.
    launcher: Literal["local", "pals", "mpich", "openmpi", "srun", "torchrun"]
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
    match: ProfileMatch | None = None
    name: str = ""
    #: Where it was read from (set by ``load_profile``).
    path: str = ""

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

    def fits(self, machine: Machine) -> str | None:
        """Why ``match`` fits ``machine`` (one phrase), or None."""
        if self.match is None:
            return None
        if self.match.cluster_name and self.match.cluster_name in machine.cluster_names:
            return f"the scheduler's cluster name is {self.match.cluster_name!r}"
        host = machine.hostname
        if self.match.hostname and (fnmatch.fnmatch(host, self.match.hostname)
                                    or fnmatch.fnmatch(host.split(".")[0], self.match.hostname)):
            return f"host {host!r} fits {self.match.hostname!r}"
        return None

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


def profile_paths() -> list[Path]:
    """Every profile by name, the first directory's where two share a name (the user's
    before the shipped ones)."""
    found: dict[str, Path] = {}
    for folder in profile_dirs():
        if folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found.setdefault(path.stem, path)
    return list(found.values())


def matching_profiles(machine: Machine, family: str | None = None) -> list[tuple[ClusterProfile, str]]:
    """The profiles whose ``match`` fits this machine (of ``family`` where given), user's first,
    each with why. A profile that does not load is skipped (``cluster check`` names it)."""
    found = []
    for path in profile_paths():
        try:
            profile = load_profile(str(path))
        except ConfigError:
            continue
        reason = profile.fits(machine)
        if reason and (family is None or profile.scheduler == family):
            found.append((profile, reason))
    return sorted(found, key=lambda pair: pair[0].scheduler != machine.scheduler)  # stable: user's first


def find_profile(machine: Machine, family: str | None = None) -> tuple[ClusterProfile, str]:
    """The profile ``render``/``submit`` use without ``--cluster``: the first that fits."""
    found = matching_profiles(machine, family)
    if not found:
        names = ", ".join(repr(n) for n in machine.cluster_names) or "none answered"
        raise ConfigError(f"no cluster profile{' for ' + family if family else ''} matches this machine (host "
                          f"{machine.hostname!r}, cluster name {names}): run `ddp-hpc cluster probe --out "
                          f"configs/clusters/NAME.yaml`, or give --cluster NAME")
    return found[0]


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
    if isinstance(data, dict) and data.get("scheduler") == "local" and data.get("launcher") == OLD_LOCAL_LAUNCHER:
        log.warning("cluster profile %s: launcher: %s is now called local (the same: ranks on this machine)",
                    path, OLD_LOCAL_LAUNCHER)
        data = {**data, "launcher": "local"}
    try:
        profile = build(ClusterProfile, data, path="")
    except ConfigError as exc:
        raise ConfigError(f"cluster profile {path}: {exc}") from None
    except TypeError as exc:  # a required key is missing
        raise ConfigError(f"cluster profile {path}: {str(exc).split('() ', 1)[-1]}") from None
    return replace(profile, name=profile.name or path.stem, path=str(path))

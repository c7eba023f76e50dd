"""Rank environment: which launcher started this process and where it sits in the job."""

from ddp_hpc.environment.base import ClusterEnvironment, DistEnv, RankInfo
from ddp_hpc.environment.hosts import expand_nodelist, read_nodefile, with_suffix
from ddp_hpc.environment.launchers import LAUNCHERS
from ddp_hpc.environment.ports import PortRange, derive_port
from ddp_hpc.environment.resolve import detect_launcher, resolve_env

__all__ = [
    "LAUNCHERS",
    "ClusterEnvironment",
    "DistEnv",
    "PortRange",
    "RankInfo",
    "derive_port",
    "detect_launcher",
    "expand_nodelist",
    "read_nodefile",
    "resolve_env",
    "with_suffix",
]

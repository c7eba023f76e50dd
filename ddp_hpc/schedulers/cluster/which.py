"""Which cluster profile fits this machine: the schedulers' names for their cluster (SLURM's
``ClusterName``, a PBS server's name) and the host's name, against each profile's ``match``."""

from __future__ import annotations

import socket

from ddp_hpc.schedulers.facts import Runner, run_readonly
from ddp_hpc.schedulers.pbs import probe as pbs_probe
from ddp_hpc.schedulers.slurm import probe as slurm_probe
from ddp_hpc.specs.profiles import ClusterProfile, Machine, find_profile


def this_machine(runner: Runner = run_readonly, hostname: str | None = None) -> Machine:
    slurm, pbs = slurm_probe.cluster_name(runner), pbs_probe.server_name(runner)
    return Machine(tuple(n for n in (slurm, pbs) if n), hostname or socket.gethostname(),
                   "slurm" if slurm else "pbs" if pbs else None)


def profile_for(family: str, runner: Runner = run_readonly) -> tuple[ClusterProfile, str]:
    """The profile ``render``/``submit FAMILY`` use without ``--cluster``, and why."""
    return find_profile(this_machine(runner), family)

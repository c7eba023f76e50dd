"""Which cluster profile fits this machine: the schedulers' names for their cluster (each
family's ``ClusterReader``: SLURM's ``ClusterName``, a PBS server's name) and the host's name, against each profile's ``match``."""

from __future__ import annotations

import socket

from ddp_hpc.schedulers import registry
from ddp_hpc.schedulers.facts import Runner, run_readonly
from ddp_hpc.specs.profiles import ClusterProfile, Machine, find_profile


def this_machine(runner: Runner = run_readonly, hostname: str | None = None) -> Machine:
    """The cluster names each family's reader hears here; the family is the first that names one."""
    names = {family: reader.cluster_name(runner) for family, reader in registry.readers().items()}
    answered = {family: name for family, name in names.items() if name}
    return Machine(tuple(answered.values()), hostname or socket.gethostname(), next(iter(answered), None))


def profile_for(family: str, runner: Runner = run_readonly) -> tuple[ClusterProfile, str]:
    """The profile ``render``/``submit FAMILY`` use without ``--cluster``, and why."""
    return find_profile(this_machine(runner), family)

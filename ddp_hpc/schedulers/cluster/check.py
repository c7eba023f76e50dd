"""``ddp-hpc cluster check PROFILE``: the profile against what the scheduler says, one line
per mismatch (the partition, its GPUs and CPUs, the account, the walltime, the launcher on
PATH, the match). Nothing it could not learn counts as a mismatch: it is a note."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass

from ddp_hpc.launch.mpi import mpi_programs
from ddp_hpc.schedulers import registry
from ddp_hpc.schedulers.cluster.node import find_mpiexec
from ddp_hpc.schedulers.cluster.probe import gpu_kind
from ddp_hpc.schedulers.facts import ClusterFacts, Runner, run_readonly
from ddp_hpc.specs.profiles import ClusterProfile


def launcher_programs(launcher: str) -> tuple[str, ...]:
    """The program a launcher needs on PATH (``torchrun``: ddp-hpc starts the ranks itself);
    an MPI flavour's from its launcher (launch/launchers/)."""
    return {"srun": ("srun",), **mpi_programs()}.get(launcher, ())


@dataclass(frozen=True)
class CheckResult:
    mismatches: tuple[str, ...]
    notes: tuple[str, ...]  # what could not be checked, and why


def check_profile(profile: ClusterProfile, facts: ClusterFacts, *, walltime_s: int, nodes: int = 1,
                  which: Callable[[str], str | None] = shutil.which, runner: Runner = run_readonly) -> CheckResult:
    bad: list[str] = []
    notes: list[str] = list(facts.notes)
    kind = registry.reader(facts.scheduler).partition_word
    if profile.scheduler != facts.scheduler:
        bad.append(f"scheduler: the profile says {profile.scheduler}, this cluster answers as {facts.scheduler}")
    if profile.match and profile.match.cluster_name and facts.cluster_name \
            and profile.match.cluster_name != facts.cluster_name:
        bad.append(f"match.cluster_name: {profile.match.cluster_name!r}, but this cluster is {facts.cluster_name!r}")
    names = ", ".join(p.name for p in facts.partitions)
    partition = facts.partition(profile.queue) if profile.queue else facts.default_partition
    if profile.queue and partition is None:
        bad.append(f"queue: {kind} {profile.queue!r} does not exist (there are: {names})")
    elif partition is None:
        notes.append(f"queue: not set and no default {kind} answered: sizes not checked")
    if partition is not None:
        bad += _against_partition(profile, partition, kind, walltime_s, nodes)
    if profile.account and facts.accounts is not None and profile.account not in facts.accounts:
        bad.append(f"account: {profile.account!r} is not one you may charge (sacctmgr lists: "
                   f"{', '.join(facts.accounts)})")
    programs = launcher_programs(profile.launcher)
    if programs and not any(which(p) for p in programs):
        bad.append(f"launcher: {profile.launcher} needs {' or '.join(programs)} on PATH; none is here")
    elif profile.launcher in mpi_programs():  # an mpiexec is here: is it this flavour's?
        found = find_mpiexec(runner, which, flavour=profile.launcher)
        if found.launcher != profile.launcher:
            bad.append(f"launcher: {profile.launcher}, but the mpiexec on PATH is not: {found.how}")
    return CheckResult(tuple(bad), tuple(notes))


def _against_partition(profile: ClusterProfile, partition, kind: str, walltime_s: int, nodes: int) -> list[str]:
    bad = []
    where = f"{kind} {partition.name}"
    gpus = partition.gpus
    if profile.uses_gpus and profile.devices_per_node:
        if gpus is None:
            bad.append(f"devices_per_node: {profile.devices_per_node} {profile.device} devices, but {where} "
                       f"declares no GPUs")
        elif gpus.count != profile.devices_per_node:
            bad.append(f"devices_per_node: {profile.devices_per_node}, but {where}'s nodes declare {gpus.count} GPUs "
                       f"(gpu:{gpus.kind + ':' if gpus.kind else ''}{gpus.count})")
    if gpus is not None and profile.device not in ("auto", "cpu"):
        found = gpu_kind(gpus)
        if found is not None and found[0] != profile.device:
            bad.append(f"device: {profile.device}, but {where}'s GPUs are {gpus.kind} ({found[2]}: {found[0]})")
    cpus_needed = profile.ranks_per_node * (profile.cpus_per_task or 1)
    if partition.cpus is not None and cpus_needed > partition.cpus:
        bad.append(f"ranks_per_node x cpus_per_task: {profile.ranks_per_node} x {profile.cpus_per_task or 1} = "
                   f"{cpus_needed} CPUs, but {where}'s nodes have {partition.cpus}")
    if partition.time_limit_s is not None and walltime_s > partition.time_limit_s:
        bad.append(f"walltime: {_hms(walltime_s)} is over {where}'s limit of {partition.time_limit}")
    if partition.nodes is not None and nodes > partition.nodes:
        bad.append(f"nodes: {nodes}, but {where} has {partition.nodes}")
    return bad


def _hms(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

"""What SLURM says about its cluster (``ddp-hpc cluster probe``): read-only queries only.

``scontrol show config`` (the cluster's name), ``sinfo`` (partitions: nodes, CPUs and memory
per node, GRES, time limit, the default), ``sacctmgr show assoc`` (the accounts a user may
charge). Each through the ``Runner`` it is given, so the parsing is tested on recorded outputs.
"""

from __future__ import annotations

import re

from ddp_hpc.schedulers.facts import ClusterFacts, ClusterReader, Gpus, LauncherFound, Partition, Runner, Which, duration_s

#: One line per partition and node configuration: name (``*`` marks the default), nodes,
#: CPUs per node, memory per node (MB), GRES, time limit.
SINFO_ARGV = ("sinfo", "-h", "-e", "-o", "%P|%D|%c|%m|%G|%l")
CONFIG_ARGV = ("scontrol", "show", "config")


def assoc_argv(user: str) -> tuple[str, ...]:
    return ("sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account")


def cluster_name(runner: Runner) -> str | None:
    """``ClusterName`` from ``scontrol show config``; None where scontrol does not answer."""
    return parse_cluster_name(runner(CONFIG_ARGV) or "")


def parse_cluster_name(text: str) -> str | None:
    match = re.search(r"^ClusterName\s*=\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else None


_GPU_GRES = re.compile(r"^gpu(?::([A-Za-z][\w.-]*))?:(\d+)")


def parse_gres(text: str) -> Gpus | None:
    """The GPUs in a GRES string: ``gpu:a100:4``, ``gpu:4(S:0-1)``, ``gpu:mi250x:8,nvme:1``;
    None for ``(null)`` or no ``gpu`` entry. Several GPU types on one node: the first."""
    for item in re.split(r",(?![^()]*\))", text.strip()):
        match = _GPU_GRES.match(item.strip())
        if match:
            return Gpus(int(match.group(2)), (match.group(1) or "").lower())
    return None


def _int(text: str) -> int | None:
    text = text.strip().rstrip("+")
    return int(text) if text.isdigit() else None


def parse_sinfo(text: str) -> tuple[tuple[Partition, ...], tuple[str, ...]]:
    """Partitions from ``SINFO_ARGV``'s output, and a note for each partition whose nodes differ
    (the smallest node is kept: a job sized for it fits every node)."""
    found: dict[str, Partition] = {}
    notes: list[str] = []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) != 6 or not fields[0].strip():
            continue
        name, nodes, cpus, memory, gres, limit = (f.strip() for f in fields)
        partition = Partition(name=name.rstrip("*"), nodes=_int(nodes), cpus=_int(cpus), memory_mb=_int(memory),
                              gpus=parse_gres(gres), time_limit_s=duration_s(limit), time_limit=limit,
                              default=name.endswith("*"))
        earlier = found.get(partition.name)
        if earlier is None:
            found[partition.name] = partition
            continue
        notes.append(f"partition {partition.name} has nodes of more than one size: the smallest is written")
        found[partition.name] = _smaller(earlier, partition)
    return tuple(found.values()), tuple(dict.fromkeys(notes))


def _smaller(a: Partition, b: Partition) -> Partition:
    def low(x: int | None, y: int | None) -> int | None:
        return min(v for v in (x, y) if v is not None) if x is not None or y is not None else None

    gpus = None if a.gpus is None or b.gpus is None else min(a.gpus, b.gpus, key=lambda g: g.count)
    return Partition(name=a.name, nodes=(a.nodes or 0) + (b.nodes or 0), cpus=low(a.cpus, b.cpus),
                     memory_mb=low(a.memory_mb, b.memory_mb), gpus=gpus, time_limit_s=a.time_limit_s,
                     time_limit=a.time_limit, default=a.default or b.default)


def parse_accounts(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(line.strip().split("|")[0] for line in text.splitlines() if line.strip()))


def read_cluster(runner: Runner, user: str) -> ClusterFacts:
    """Everything SLURM's query commands answer; what they do not is a note."""
    notes: list[str] = []
    config = runner(CONFIG_ARGV)
    name = parse_cluster_name(config or "")
    if name is None:
        notes.append("cluster name: `scontrol show config` did not answer")
    sinfo = runner(SINFO_ARGV)
    if sinfo is None:
        partitions: tuple[Partition, ...] = ()
        notes.append("partitions: `sinfo` did not answer")
    else:
        partitions, size_notes = parse_sinfo(sinfo)
        notes.extend(size_notes)
    assoc = runner(assoc_argv(user))
    accounts = parse_accounts(assoc) if assoc is not None else None
    if accounts is None:
        notes.append(f"accounts: `sacctmgr show assoc user={user}` did not answer (no accounting database?)")
    elif not accounts:
        notes.append(f"accounts: `sacctmgr` lists no association for user {user}")
    return ClusterFacts("slurm", name, partitions, accounts or None, tuple(notes))


class SlurmReader(ClusterReader):
    """SLURM's answers to ``ddp-hpc cluster probe|check|which``."""

    partition_word = "partition"
    commands = "scontrol show config, sinfo, sacctmgr show assoc"
    usual_launcher = "srun"
    asked_at = 10  # before PBS: Slurm's PBS wrappers (slurm-wlm-torque) answer qstat too

    def cluster_name(self, runner: Runner) -> str | None:
        return cluster_name(runner)

    def read_cluster(self, runner: Runner, user: str) -> ClusterFacts:
        return read_cluster(runner, user)

    def find_launcher(self, runner: Runner, which: Which) -> LauncherFound:
        path = which("srun")
        return LauncherFound("srun" if path else None, f"srun at {path}" if path else "no srun on PATH")

"""What PBS says about its cluster (``ddp-hpc cluster probe --scheduler pbs``): read-only queries.

``qstat -B -f`` (the server's name and default queue), ``qstat -Q -f`` (queues, their walltime
limit), ``pbsnodes -a`` (CPUs and GPUs per node: PBS Pro's ``resources_available.ncpus`` and
``ngpus``, Torque's and Slurm's wrappers' ``np`` and ``gpus``). Slurm's PBS wrappers
(slurm-wlm-torque) answer ``qstat -Q[f]`` and ``pbsnodes`` but not ``qstat -B -f``: no server
name, no default queue, no walltime limits; each is a note.
"""

from __future__ import annotations

import re

from ddp_hpc.schedulers.cluster.node import find_mpiexec
from ddp_hpc.schedulers.facts import ClusterFacts, ClusterReader, Gpus, LauncherFound, Partition, Runner, Which, duration_s

SERVER_ARGV = ("qstat", "-B", "-f")
QUEUES_ARGV = ("qstat", "-Q", "-f")
NODES_ARGV = ("pbsnodes", "-a")


def blocks(text: str, header: re.Pattern[str]) -> dict[str, dict[str, str]]:
    """``Name`` -> its ``key = value`` lines, for the block formats of qstat -f and pbsnodes."""
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        head = header.match(line)
        if head:
            current = found.setdefault(head.group(1).strip(), {})
        elif current is not None and "=" in line and line[:1].isspace():
            key, _, value = line.partition("=")
            current[key.strip()] = value.strip()
    return found


_SERVER = re.compile(r"^Server:\s*(\S+)")
_QUEUE = re.compile(r"^Queue:\s*(\S+)")
_NODE = re.compile(r"^(\S+)\s*$")


def server_name(runner: Runner) -> str | None:
    """The PBS server's name (``qstat -B -f``); None where it does not answer."""
    servers = blocks(runner(SERVER_ARGV) or "", _SERVER)
    return next(iter(servers), None)


def _int(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() else None


def node_size(attributes: dict[str, str]) -> tuple[int | None, Gpus | None]:
    """CPUs and GPUs of one ``pbsnodes -a`` block (PBS Pro's names first, then Torque's)."""
    cpus = _int(attributes.get("resources_available.ncpus")) or _int(attributes.get("np"))
    count = _int(attributes.get("resources_available.ngpus"))
    if count is None:
        count = _int(attributes.get("gpus"))
    kind = attributes.get("resources_available.gpu_type", "")
    gres = re.search(r"gres=gpu:([A-Za-z][\w.-]*):\d+", attributes.get("status", ""))
    if gres and not kind:
        kind = gres.group(1)
    return cpus, Gpus(count, kind.lower()) if count else None


def read_cluster(runner: Runner) -> ClusterFacts:
    notes: list[str] = []
    server = blocks(runner(SERVER_ARGV) or "", _SERVER)
    name = next(iter(server), None)
    default_queue = next(iter(server.values()), {}).get("default_queue")
    if name is None:
        notes.append("server name and default queue: `qstat -B -f` did not answer (Slurm's PBS wrappers do not)")
    queues_text = runner(QUEUES_ARGV)
    queues = blocks(queues_text or "", _QUEUE)
    if queues_text is None:
        notes.append("queues: `qstat -Q -f` did not answer")
    nodes = blocks(runner(NODES_ARGV) or "", _NODE)
    if not nodes:
        notes.append("node sizes: `pbsnodes -a` did not answer")
    sizes = {node: node_size(attributes) for node, attributes in nodes.items()}
    if nodes and not any(a.get("queue") for a in nodes.values()):
        notes.append("PBS ties no nodes to a queue here: each queue's CPUs and GPUs are the smallest node's")
    partitions = []
    for queue, attributes in queues.items():
        mine = [sizes[n] for n, a in nodes.items() if a.get("queue") == queue] or list(sizes.values())
        limit = attributes.get("resources_max.walltime", "")
        if not limit:
            notes.append(f"queue {queue}: no walltime limit said (resources_max.walltime)")
        cpus = [c for c, _ in mine if c is not None]
        gpus = [g for _, g in mine]
        partitions.append(Partition(
            name=queue, nodes=len(mine) or None, cpus=min(cpus) if cpus else None, memory_mb=None,
            gpus=None if not gpus or any(g is None for g in gpus) else min(gpus, key=lambda g: g.count),
            time_limit_s=duration_s(limit) if limit else None, time_limit=limit, default=queue == default_queue))
    notes.append("accounts: PBS has no query for the projects a user may charge")
    return ClusterFacts("pbs", name, tuple(partitions), None, tuple(notes))


class PbsReader(ClusterReader):
    """PBS's answers (PBS Pro's qstat and pbsnodes, or Slurm's PBS wrappers as far as they go)."""

    commands = "qstat -B -f, qstat -Q -f, pbsnodes -a"
    usual_launcher = "mpich"
    asked_at = 20

    def cluster_name(self, runner: Runner) -> str | None:
        return server_name(runner)

    def answers(self, runner: Runner) -> bool:
        return runner(QUEUES_ARGV) is not None  # Slurm's PBS wrappers answer it too: SLURM is asked first

    def read_cluster(self, runner: Runner, user: str) -> ClusterFacts:
        return read_cluster(runner)

    def find_launcher(self, runner: Runner, which: Which) -> LauncherFound:
        return find_mpiexec(runner, which)

"""``ddp-hpc cluster probe``: a commented cluster profile from the scheduler's answers.

The family's commands say the partitions (its ``ClusterReader``: ``slurm/probe.py``,
``pbs/probe.py``, or a site family's), the node says its GPUs and interfaces where the probe
runs inside a job (``node.py``). Every value
written comes from an answer; what no command answered is a commented line that says so.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddp_hpc.errors import UserError
from ddp_hpc.schedulers import registry
from ddp_hpc.schedulers.cluster.node import NodeFacts, in_job, read_node
from ddp_hpc.schedulers.facts import ClusterFacts, ClusterReader, Gpus, LauncherFound, Partition, Runner, Which

#: GPU types as SLURM's GRES and PBS's gpu_type name them -> (device, backend, vendor). AMD's
#: run torch's ROCm build, whose ``cuda`` device is HIP and whose ``nccl`` backend is RCCL.
GPU_KINDS: tuple[tuple[tuple[str, ...], tuple[str, str, str]], ...] = (
    (("a100", "a40", "a30", "a10", "h100", "h200", "gh200", "b200", "gb200", "v100", "l40", "l40s", "l4", "t4",
      "rtx", "nvidia"), ("cuda", "nccl", "NVIDIA")),
    (("mi100", "mi210", "mi250", "mi250x", "mi300a", "mi300x", "amd", "gfx90a", "gfx942"),
     ("cuda", "nccl", "AMD (torch's ROCm build: cuda is HIP, nccl is RCCL)")),
    (("pvc", "max1550", "max1100", "intel"), ("xpu", "xccl", "Intel")),
)

def gpu_kind(gpus: Gpus) -> tuple[str, str, str] | None:
    """(device, backend, vendor) of a GPU type, or None where the type is not named or not known."""
    for names, answer in GPU_KINDS:
        if gpus.kind in names or any(gpus.kind.startswith(n) for n in names if len(n) > 3):
            return answer
    return None


@dataclass(frozen=True)
class Probe:
    facts: ClusterFacts
    reader: ClusterReader
    launcher: LauncherFound
    node: NodeFacts | None  # None: the probe did not run inside a job
    host: str
    #: The launchers a profile of this family may name (its backends').
    launchers: tuple[str, ...] = ()


def detect_scheduler(runner: Runner) -> str:
    """The first family (``ClusterReader.asked_at``) whose scheduler answers here."""
    readers = registry.readers()
    for name, reader in readers.items():
        if reader.answers(runner):
            return name
    raise UserError(f"no scheduler answered ({'; '.join(f'{name}: {r.commands}' for name, r in readers.items())}): run "
                    f"the probe on the cluster's login node, or give --scheduler {'|'.join(readers)}")


def probe(scheduler: str | None, runner: Runner, *, user: str, environ: Mapping[str, str],
          root: Path = Path("/"), which: Which = shutil.which, host: str | None = None) -> Probe:
    family = scheduler or detect_scheduler(runner)
    reader = registry.reader(family)
    facts = reader.read_cluster(runner, user)
    if not facts.partitions:
        raise UserError(f"{family}: no {reader.partition_word} answered ({'; '.join(facts.notes)}): is this the "
                        f"cluster's login node?")
    node = read_node(root) if in_job(environ) else None
    launchers = tuple(dict.fromkeys(name for backend in registry.scheduler_families()[family].backends
                                    for name in backend.launchers))
    return Probe(facts, reader, reader.find_launcher(runner, which), node, host or socket.gethostname(), launchers)


@dataclass(frozen=True)
class Shape:
    """Ranks and devices per node for one partition, and why."""
    ranks_per_node: int
    devices_per_node: int
    device: str
    backend: str
    cpus_per_task: int | None
    why: str


def shape(partition: Partition) -> Shape | None:
    """One rank per GPU on a GPU partition; one rank per node with all its CPUs otherwise;
    None where the partition's node size was not said."""
    if partition.gpus is not None:
        kind = gpu_kind(partition.gpus)
        device, backend, vendor = kind or ("auto", "auto", "")
        cpus = partition.cpus // partition.gpus.count if partition.cpus else None
        why = (f"{partition.gpus.count} x {partition.gpus.kind or 'GPU'} per node, {vendor}" if kind else
               f"{partition.gpus.count} GPUs per node of a type not named or not known "
               f"({partition.gpus.kind or 'no type'}): device and backend are chosen on the node")
        return Shape(partition.gpus.count, partition.gpus.count, device, backend, cpus or None, why)
    if partition.cpus is None:
        return None
    return Shape(1, 0, "cpu", "gloo", partition.cpus,
                 f"no GPUs declared: one rank per node with its {partition.cpus} CPUs (raise ranks_per_node "
                 f"and lower cpus_per_task to taste)")


def _partition_line(p: Partition) -> str:
    gpus = f"{p.gpus.count} x {p.gpus.kind or 'gpu'}" if p.gpus else "no GPUs"
    return (f"#   {p.name}{' (default)' if p.default else ''}: {p.nodes if p.nodes is not None else '?'} nodes, "
            f"{p.cpus if p.cpus is not None else '?'} CPUs, "
            f"{str(p.memory_mb) + ' MB' if p.memory_mb is not None else '? MB'}, {gpus}, "
            f"time limit {p.time_limit or 'not said'}")


def profile_text(found: Probe, *, when: float | None = None) -> str:
    """The profile as YAML with comments; ``yaml.safe_load`` reads it, ``load_profile`` checks it."""
    facts = found.facts
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when if when is not None else time.time()))
    reader = found.reader
    lines = [f"# Written by `ddp-hpc cluster probe` on {found.host}, {stamp}, from {facts.scheduler.upper()}'s own",
             f"# answers ({reader.commands}). Check it against the cluster: ddp-hpc cluster check FILE",
             "# Lines that start with '# not learned' name what no command answered: fill them in by hand."]
    if facts.cluster_name:
        lines += ["match:", f"  cluster_name: {facts.cluster_name}  # picked without --cluster where this name answers"]
    else:
        lines += ["# not learned: the cluster's name (no match: block); add one, e.g.",
                  f"# match: {{hostname: '{found.host.split('.')[0].rstrip('0123456789')}*'}}"]
    lines.append(f"scheduler: {facts.scheduler}")
    if found.launcher.launcher:
        lines.append(f"launcher: {found.launcher.launcher}  # {found.launcher.how}")
    else:
        lines += [f"# not learned: the launcher ({found.launcher.how}); one of {', '.join(found.launchers)}",
                  f"launcher: {reader.usual_launcher}"]
        lines[-1] += "  # NOT FOUND on this PATH: the family's usual one, check it"
    lines.append("# partitions and queues: nodes, CPUs per node, memory per node, GPUs per node, time limit")
    lines += [_partition_line(p) for p in facts.partitions]
    chosen = facts.default_partition
    if chosen is None:
        lines.append(f"# not learned: the default {reader.partition_word}; "
                     f"set queue: to one of {', '.join(p.name for p in facts.partitions)}")
        chosen = facts.partitions[0]
        lines.append(f"# the node shape below is queue {chosen.name}'s")
    else:
        lines.append(f"queue: {chosen.name}")
    lines += _shape_lines(chosen, found.node)
    chosen_shape = shape(chosen)
    for other in facts.partitions:
        other_shape = shape(other)
        if other is not chosen and other_shape is not None and (chosen_shape is None or (
                other_shape.device, other_shape.ranks_per_node) != (chosen_shape.device, chosen_shape.ranks_per_node)):
            lines.append(f"# for {other.name} (--partition {other.name}, or a copy of this file with queue: "
                         f"{other.name}): ranks_per_node: {other_shape.ranks_per_node}, devices_per_node: "
                         f"{other_shape.devices_per_node}, device: {other_shape.device}, backend: {other_shape.backend}"
                         + (f", cpus_per_task: {other_shape.cpus_per_task}" if other_shape.cpus_per_task else ""))
    lines += _account_lines(facts)
    lines += _node_lines(found.node)
    lines += [f"# note: {note}" for note in facts.notes if not note.startswith("accounts")]
    lines += ["setup: []", "env: {}" if not _env(found.node) else "env:"]
    lines += [f"  {k}: {v}  # the high-speed interface, not the default route's" for k, v in _env(found.node).items()]
    return "\n".join(lines) + "\n"


def _shape_lines(partition: Partition, node: NodeFacts | None) -> list[str]:
    found = shape(partition)
    if found is None:
        return [f"# not learned: {partition.name}'s node size (CPUs, GPUs): set ranks_per_node by hand",
                "ranks_per_node: 1  # NOT LEARNED: one rank per node until you set it", "device: auto",
                "backend: auto"]
    lines = [f"# {partition.name}: {found.why}", f"ranks_per_node: {found.ranks_per_node}",
             f"devices_per_node: {found.devices_per_node}", f"device: {found.device}", f"backend: {found.backend}"]
    if found.cpus_per_task:
        lines.append(f"cpus_per_task: {found.cpus_per_task}")
    if node is not None and found.devices_per_node and node.nvidia_gpus + node.amd_gpus not in (0, found.devices_per_node):
        lines.append(f"# the node this ran on shows {node.nvidia_gpus + node.amd_gpus} GPUs, the scheduler declares "
                     f"{found.devices_per_node}: check gres.conf or the partition")
    return lines


def _account_lines(facts: ClusterFacts) -> list[str]:
    note = next((n for n in facts.notes if n.startswith("accounts")), "accounts: not learned")
    if not facts.accounts:
        return [f"# not learned: {note}; set account: or pass --account"]
    if len(facts.accounts) == 1:
        return [f"account: {facts.accounts[0]}  # the one account sacctmgr lists for you"]
    return [f"# accounts you may charge (sacctmgr): {', '.join(facts.accounts)}; pick one with --account or",
            f"# account: {facts.accounts[0]}"]


def _node_lines(node: NodeFacts | None) -> list[str]:
    if node is None:
        return ["# not learned: the node's own GPUs and network interfaces (the probe ran outside a job); run it in a",
                "# one-node job to learn them (SLURM: srun -N1 ddp-hpc cluster probe --out FILE)"]
    lines = [f"# this compute node: {node.nvidia_gpus} NVIDIA and {node.amd_gpus} AMD GPUs seen; interfaces "
             f"{', '.join(node.interfaces) or 'none'}; default route via {node.default_route or 'none'}"]
    if node.fast_interface is None:
        lines.append("# gloo and NCCL use the default route's interface: no interface named")
    return lines


def _env(node: NodeFacts | None) -> dict[str, str]:
    if node is None or node.fast_interface is None:
        return {}
    return {"GLOO_SOCKET_IFNAME": node.fast_interface, "NCCL_SOCKET_IFNAME": node.fast_interface}

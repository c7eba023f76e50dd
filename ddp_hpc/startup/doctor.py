"""``ddp-hpc doctor``: start the group, show every rank, prove the collectives work."""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_hpc.device import backend_label
from ddp_hpc.startup.distributed import DistContext


@dataclass(frozen=True)
class RankReport:
    """What one rank knows about itself, gathered on rank 0."""

    rank: int
    world_size: int
    node_rank: int
    host: str
    local_rank: int
    local_world_size: int
    device: str
    backend: str
    source: str
    torch: str
    pid: int

    @classmethod
    def of(cls, ctx: DistContext) -> RankReport:
        env = ctx.env
        return cls(env.rank, env.world_size, env.node_rank, socket.gethostname(), env.local_rank,
                   env.local_world_size, str(ctx.device.torch_device), backend_label(ctx.device.backend),
                   env.source, torch.__version__, os.getpid())


def find_problems(reports: Sequence[RankReport]) -> list[str]:
    """Disagreements between the ranks' own views of the job (empty when healthy)."""
    problems = []
    world_sizes = {r.world_size for r in reports}
    if world_sizes != {len(reports)}:
        problems.append(f"ranks report world sizes {sorted(world_sizes)} but {len(reports)} joined")
    ranks = sorted(r.rank for r in reports)
    if ranks != list(range(len(reports))):
        problems.append(f"ranks are {ranks}, expected 0..{len(reports) - 1} once each")
    for attribute in ("backend", "torch", "source"):
        values = {getattr(r, attribute) for r in reports}
        if len(values) > 1:
            problems.append(f"ranks disagree on {attribute}: {sorted(values)}")

    by_node: dict[int, list[RankReport]] = defaultdict(list)
    for report in reports:
        by_node[report.node_rank].append(report)
    for node, members in sorted(by_node.items()):
        hosts = {r.host for r in members}
        if len(hosts) > 1:
            problems.append(f"node rank {node} spans hosts {sorted(hosts)}")
        local = sorted(r.local_rank for r in members)
        if local != list(range(len(members))):
            problems.append(f"node rank {node} has local ranks {local}, expected 0..{len(members) - 1}")
        if {r.local_world_size for r in members} != {len(members)}:
            problems.append(f"node rank {node} has {len(members)} ranks but they report local "
                            f"world sizes {sorted({r.local_world_size for r in members})}")
        accelerators = [r.device for r in members if r.device != "cpu"]
        duplicates = sorted({d for d in accelerators if accelerators.count(d) > 1})
        if duplicates and len({r.host for r in members}) == 1:
            problems.append(f"node rank {node}: several ranks share device {duplicates}")
    return problems


def format_table(reports: Sequence[RankReport]) -> str:
    names = [f.name for f in fields(RankReport)]
    rows = [names] + [[str(v) for v in astuple(r)] for r in sorted(reports, key=lambda r: r.rank)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(names))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def check_all_reduce(ctx: DistContext) -> str | None:
    """Sum rank+1 over all ranks; the answer is known in closed form."""
    total = ctx.all_reduce([ctx.rank + 1.0])[0]
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    return None if total == expected else f"all_reduce gave {total}, expected {expected}"


def check_parameter_sync(ctx: DistContext) -> str | None:
    """Build a model differently on every rank, wrap it in DDP and take one step.

    DDP must broadcast rank 0's parameters at construction and average the gradients,
    so every rank ends with identical weights; a checksum per rank shows it.
    """
    device = ctx.device.torch_device
    generator = torch.Generator().manual_seed(1000 + ctx.rank)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    model = model.to(device)
    if ctx.group_initialized:
        model = DistributedDataParallel(model, device_ids=ctx.device.ddp_device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 16, generator=generator).to(device)
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    checksum = float(sum(p.detach().double().sum().item() for p in model.parameters()))
    checksums = ctx.all_gather_object(checksum)
    if len(set(checksums)) != 1:
        return f"parameters differ after one DDP step: checksums {checksums}"
    return None


def run_doctor(ctx: DistContext) -> tuple[bool, str]:
    """(healthy, report text); the verdict is rank 0's, shared with every rank."""
    reports = ctx.all_gather_object(RankReport.of(ctx))
    problems = find_problems(reports)
    for check in (check_all_reduce, check_parameter_sync):
        problem = check(ctx)
        if problem:
            problems.append(f"rank {ctx.rank}: {problem}")
    problems = [p for rank_problems in ctx.all_gather_object(problems) for p in rank_problems]
    problems = list(dict.fromkeys(problems))
    nodes = len({r.node_rank for r in reports})
    lines = [format_table(reports), ""]
    if problems:
        lines += [f"doctor: FAILED: {p}" for p in problems]
    else:
        lines.append(f"doctor: OK: {len(reports)} ranks on {nodes} node(s), backend "
                     f"{reports[0].backend}, all_reduce correct, parameters in sync after a DDP step")
    return not problems, "\n".join(lines)

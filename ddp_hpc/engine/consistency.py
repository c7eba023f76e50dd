"""Silent data corruption: do all ranks still hold the same weights?

Data parallel training keeps one copy of the model per rank, identical after every step.
A bit flipped in one copy (a bad memory cell, a faulty accelerator) raises no error: that
rank's gradients differ from then on, DDP averages them into everyone's, and the run goes
on training a model nobody can reproduce. ``check_weights`` hashes this rank's parameters
bit for bit and compares the hashes of all ranks with one small all-gather (one int64 per
rank); ``WeightsCheck`` does it every N steps.

    from ddp_hpc.engine.consistency import WeightsCheck

    check = WeightsCheck(every=100)
    for step, batch in enumerate(loader, 1):
        ...
        optimizer.step()
        check.after_step(model, step)   # raises WeightsDivergedError naming the rank

The hash is exact, not a float sum: each parameter's elements are read as integers of
their own width and summed (wrapping at 64 bits), and the parameters are mixed with odd
weights, so any single flipped bit changes it. It costs one pass over the parameters on
their device and one all-gather of 8 bytes per rank.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS_64 = (1 << 64) - 1


def weights_hash(parameters: Iterable[torch.Tensor]) -> int:
    """A 64-bit hash of the parameters' exact bits (the same on every rank iff the bits are)."""
    total = 0
    with torch.no_grad():
        for index, parameter in enumerate(parameters):
            data = parameter.detach()
            if data.is_complex():
                data = torch.view_as_real(data)
            bits = data.contiguous().view(_INT_OF_WIDTH[data.element_size()]).to(torch.int64).sum().item()
            # Odd weights are invertible modulo 2**64: a change in one parameter cannot vanish.
            total = (total + bits * (2 * index + 1)) & _BITS_64
    return total - (1 << 64) if total >= 1 << 63 else total  # as a signed int64, all 64 bits kept


@dataclass(frozen=True)
class Divergence:
    """What the check found: the ranks whose weights differ from the majority's."""

    step: int
    odd_ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    majority: bool

    def describe(self) -> str:
        named = ", ".join(f"rank {r} (host {h})" for r, h in zip(self.odd_ranks, self.hosts))
        if self.majority:
            return (f"silent data corruption: {named} hold(s) weights that differ from every other rank's at "
                    f"step {self.step} (checked with distributed.weights_check_every); stop using that node and "
                    f"resume from the last checkpoint")
        return (f"silent data corruption: the ranks' weights differ at step {self.step} and no copy has a "
                f"majority: {named}; resume from the last checkpoint")


class WeightsDivergedError(RuntimeError):
    """The ranks no longer hold the same weights."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.describe())
        self.divergence = divergence


def find_divergence(hashes: Sequence[int], hosts: Sequence[str], step: int) -> Divergence | None:
    """The ranks outside the largest group of equal hashes (None when all agree)."""
    counts = Counter(hashes)
    if len(counts) <= 1:
        return None
    (common, top), *rest = counts.most_common()
    majority = not rest or top > rest[0][1]
    odd = tuple(r for r, h in enumerate(hashes) if h != common) if majority else tuple(range(len(hashes)))
    return Divergence(step, odd, tuple(hosts[r] for r in odd), majority)


def check_weights(model: torch.nn.Module, step: int, group: dist.ProcessGroup | None = None) -> None:
    """Compare this rank's weights with every other rank's (collective: all ranks call it at the
    same step). Raises ``WeightsDivergedError`` on every rank when they differ."""
    if not dist.is_available() or not dist.is_initialized():
        return
    parameters = list(model.parameters())
    device = parameters[0].device if parameters else torch.device("cpu")
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    mine = torch.tensor([weights_hash(parameters)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    hashes = [int(t.item()) for t in gathered]
    if len(set(hashes)) == 1:
        return
    hosts: list[str | None] = [None] * len(hashes)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)  # only on the way out
    divergence = find_divergence(hashes, [str(h) for h in hosts], step)
    assert divergence is not None
    raise WeightsDivergedError(divergence)


@dataclass(frozen=True)
class WeightsCheck:
    """``check_weights`` every ``every`` steps (steps counted by the caller, from 1)."""

    every: int

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError(f"WeightsCheck(every={self.every}) must be > 0")

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def after_step(self, model: torch.nn.Module, step: int, group: dist.ProcessGroup | None = None) -> None:
        if self.due(step):
            check_weights(model, step, group)

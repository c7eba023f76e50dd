"""Per-sample values summed on the device, reduced over ranks once per epoch."""

from __future__ import annotations

import torch

from ddp_hpc.startup.distributed import DistContext


class MetricSums:
    """Sums of per-sample values and the sample count, kept as device tensors.

    Nothing here synchronises with the host: the hot loop never calls ``.item()``.
    ``reduce`` sums over ranks (float64) and returns sample-weighted means.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, per_sample: dict[str, torch.Tensor], mask: torch.Tensor | None = None) -> None:
        for name, values in per_sample.items():
            values = values.detach().reshape(-1).to(torch.float64)
            if mask is not None:
                values = values * mask
            total = self.sums.get(name)
            self.sums[name] = values.sum() if total is None else total + values.sum()
        first = next(iter(per_sample.values()), None)
        if first is not None:
            self.count += mask.sum() if mask is not None else first.reshape(-1).shape[0]

    def copy(self) -> MetricSums:
        """The sums as they are now (later ``add``s change only this object)."""
        kept = MetricSums(self.device)
        kept.sums = {name: total.clone() for name, total in self.sums.items()}
        kept.count = self.count.clone()
        return kept

    def reduce(self, ctx: DistContext) -> tuple[dict[str, float], int]:
        """(means over every sample of every rank, number of samples)."""
        names = sorted(self.sums)
        local = [self.sums[n] for n in names] + [self.count]
        totals = ctx.all_reduce([float(v) for v in torch.stack(local).cpu().tolist()]) if local else []
        count = int(round(totals[-1])) if totals else 0
        means = {name: totals[i] / count for i, name in enumerate(names)} if count else {}
        return means, count

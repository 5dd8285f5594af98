"""Which process this is in the training group, and small collectives over the group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, writes the adapter and prints progress."""
        return self.rank == 0


def max_over_ranks(value: float, ctx: RankContext) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def on_every_rank(flag: bool, ctx: RankContext) -> bool:
    """True only if `flag` is true on every rank (a choice all ranks must make alike)."""
    t = torch.tensor([int(flag)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def combined_figures(total: torch.Tensor, sums: torch.Tensor, maxima: int) -> torch.Tensor:
    """Two micro-batches' figures as one: sums added, the last `maxima` kept at their largest."""
    if not maxima:
        return total + sums
    cut = len(total) - maxima
    return torch.cat([total[:cut] + sums[:cut], torch.maximum(total[cut:], sums[cut:])])


def split_maxima(figures: torch.Tensor, maxima: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sums, the last `maxima` figures): all-reduced apart, by SUM and by MAX."""
    cut = len(figures) - maxima
    return figures[:cut], figures[cut:]

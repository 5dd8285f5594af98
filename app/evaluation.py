"""Evaluation on the held-out set: mean loss per target token, the same for any worker count."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from app.loss import summed_token_loss, target_token_count
from app.ranks import RankContext
from app.stream import to_device


@torch.no_grad()
def evaluate_loss(model, eval_pass: Callable[[], Iterable], ctx: RankContext, chunk_tokens: int = 0) -> float:
    """Mean loss per target token over the whole eval set.

    Every rank reads all eval batches and scores batches rank, rank + world, ...; ranks with fewer
    batches run an extra forward with no weight, since FSDP needs every rank in every forward.
    """
    was_training = model.training
    model.eval()
    batches = [to_device(b, ctx.device) for b in eval_pass()]
    mine = batches[ctx.rank::ctx.world_size]
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for i in range(math.ceil(len(batches) / ctx.world_size)):
        batch = mine[i] if i < len(mine) else batches[0]
        token_loss = summed_token_loss(model, batch, chunk_tokens)
        if i < len(mine):
            totals += torch.stack([token_loss.double(), target_token_count(batch["labels"]).double()])
    dist.all_reduce(totals)
    model.train(was_training)
    return (totals[0] / totals[1]).item()


def eval_metrics(eval_loss: float) -> dict[str, float]:
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50))}

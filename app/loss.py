"""Causal-LM loss, normalised by the number of target tokens in the whole global batch.

Each micro-batch contributes `sum of token losses / N`, where N counts the unmasked tokens over
every micro-batch of every rank in this optimizer step. Summed over micro-batches and ranks that is
exactly the mean over the global batch, whatever the worker count or accumulation split, so one
worker and two workers given the same global batch take the same step. FSDP averages gradients over
ranks, so the loss a rank backpropagates is scaled by the world size to turn that average into the sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from app.formatting import IGNORE_INDEX


def target_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry loss: labels are shifted by one, so the first position never does."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def global_target_tokens(micro_batches: list[dict]) -> torch.Tensor:
    """N for this step: one all-reduce of a scalar, before any forward pass."""
    count = sum(target_token_count(b["labels"]) for b in micro_batches).to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(count)
    return count


def scaled_micro_batch_loss(model, batch: dict, global_tokens: torch.Tensor, world_size: int):
    """What one rank backpropagates for one micro-batch; returns (that loss, its unscaled token sum)."""
    token_sum = summed_token_loss(model, batch)
    return token_sum * (world_size / global_tokens), token_sum.detach()


def summed_token_loss(model, batch: dict) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the unmasked tokens of one micro-batch."""
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")

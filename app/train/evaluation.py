"""Evaluation on the held-out set, the same for any worker count: mean loss per target token, or any sums
that an objective scores each batch with (app/train/objectives.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.config.objectives import LOWER_IS_BETTER
from app.data.chat import IGNORE_INDEX
from app.data.stream import to_device
from app.train.group import RankContext
from app.train.host_memory import release_free_host_memory
from app.train.loss import summed_token_loss, target_token_count


def evaluate_loss(model, eval_pass: Callable[[], Iterable], ctx: RankContext, chunk_tokens: int = 0) -> float:
    """Mean loss per target token over the whole eval set."""
    totals = dealt_eval_sums(model, eval_pass, ctx, lambda batch: torch.stack([
        summed_token_loss(model, batch, chunk_tokens).double(), target_token_count(batch["labels"]).double()]))
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def dealt_eval_sums(model, eval_pass: Callable[[], Iterable], ctx: RankContext,
                    score: Callable[[dict], torch.Tensor]) -> torch.Tensor:
    """`score(batch)` (a vector of sums) added up over the whole eval set, the same on every rank.

    Every rank reads all eval batches and scores batches rank, rank + world, ...; ranks with fewer
    batches run an extra forward with no weight, since FSDP needs every rank in every forward.
    """
    was_training = model.training
    model.eval()
    batches = [to_device(cut_after_last_target(b), ctx.device) for b in eval_pass()]
    if not batches:
        raise RuntimeError("no eval rows reached this worker (the driver refuses an empty eval set)")
    mine = batches[ctx.rank::ctx.world_size]
    totals = None
    for i in range(math.ceil(len(batches) / ctx.world_size)):
        sums = score(mine[i] if i < len(mine) else batches[0])
        release_free_host_memory()  # each batch has its own length: the heap would keep what it left
        if i < len(mine):
            totals = sums if totals is None else totals + sums
    if totals is None:  # this rank had no batch of its own; the stand-in forward gave the shape
        totals = torch.zeros_like(sums)
    dist.all_reduce(totals)
    model.train(was_training)
    return totals


def cut_after_last_target(batch: dict) -> dict:
    """The batch's rows without the columns after its last target token: only padding or untrained tail
    there, and under the causal mask no position before attends to them, so the loss is the same for a
    fraction of the compute (eval rows are padded to data.max_seq_len; most records are far shorter)."""
    if "labels" not in batch:  # preference pairs: app/train/preference.py cuts both sides together
        return batch
    labels = torch.as_tensor(batch["labels"])
    targets = (labels != IGNORE_INDEX).any(0).nonzero()
    width = int(targets[-1, 0]) + 1 if len(targets) else 1
    return {k: v[:, :width] if getattr(v, "ndim", 0) == 2 and v.shape[1] == labels.shape[1] else v
            for k, v in batch.items()}


def eval_metrics(eval_loss: float) -> dict[str, float]:
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50))}


@dataclass
class BestEvaluation:
    """The best evaluation of a run so far by `metric` (lower is better for loss and perplexity, higher for
    task metrics), and how many evaluations in a row have not beaten it: early stopping's count. Kept in
    every checkpoint, so a restarted or resumed run ranks against the same best."""

    metric: str
    patience: int | None = None
    value: float | None = None
    step: int | None = None
    evals_since: int = 0

    def update(self, step: int, figures: dict[str, float]) -> bool:
        """Rank one evaluation; True when it is the new best. (A NaN figure never is.)"""
        value = figures[self.metric]
        if self.value is None:
            better = math.isfinite(value)
        else:
            better = value < self.value if self.metric in LOWER_IS_BETTER else value > self.value
        if better:
            self.value, self.step, self.evals_since = value, step, 0
            return True
        self.evals_since += 1
        return False

    @property
    def patience_spent(self) -> bool:
        return self.patience is not None and self.evals_since >= self.patience

    def state(self) -> dict:
        return {"value": self.value, "step": self.step, "evals_since": self.evals_since}

"""Direct Preference Optimization: the loss of a micro-batch of (chosen, rejected) pairs, and its metrics.

The policy is the PEFT LoRA model; the reference is the same model with its LoRA layers switched off, run
without gradients: no second copy of the weights (or, when the run starts from a trained adapter, that
adapter: a frozen second adapter in the same sharded model). Chosen and rejected answers go through one forward,
concatenated along the batch (rows 0..B-1 chosen, B..2B-1 rejected), as the reference's do.

Normalisation as in app/train/loss.py, with pairs in place of target tokens: each micro-batch
contributes `sum of its pairs' losses / P`, P the pairs of the whole optimizer step over every rank,
scaled by the world size since FSDP averages gradients over ranks. So 1 and N workers, and any
accumulation split, take the same step: the mean over the global batch's pairs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from app.data.chat import IGNORE_INDEX
from app.model.adapter import REFERENCE
from app.train.loss import token_losses

# TRL's metric names, so curves compare across tools; each is a mean over pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def concatenated(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels of the chosen rows, then the rejected rows, right-padded to one width and cut
    after the last target token (rows arrive padded to data.max_seq_len; what follows the last answer token
    changes no log-prob under the causal mask). Any id pads, and pads carry no loss."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

    def side(name: str, pad: int) -> torch.Tensor:
        rows = batch[name]
        return F.pad(rows, (0, width - rows.shape[1]), value=pad)

    ids = torch.cat([side("chosen_input_ids", 0), side("rejected_input_ids", 0)])
    labels = torch.cat([side("chosen_labels", IGNORE_INDEX), side("rejected_labels", IGNORE_INDEX)])
    targets = (labels != IGNORE_INDEX).any(0).nonzero()
    width = int(targets[-1, 0]) + 1 if len(targets) else 1
    return ids[:, :width], labels[:, :width]


def sequence_logps(model, input_ids: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """log p(answer | prompt) of each row: the log-probs of its target tokens (labels != -100), summed. With
    `chunk_tokens` (train.loss_chunk_tokens), from the logits of that many positions at a time, as the SFT loss."""
    return -token_losses(model, {"input_ids": input_ids, "labels": labels}, chunk_tokens).sum(-1)


@contextmanager
def tuner_layers_set(model, attribute: str, value):
    """Every PEFT tuner layer's `attribute` set to `value`, then back as it was.

    What the reference forward switches: `_disable_adapters` (the bare base) or `_active_adapter` (the frozen
    starting adapter). Not PEFT's `disable_adapter()` / `set_adapter()`: those also set requires_grad off and
    on, and under FSDP2 the second call lands on the parameters registered at that moment, the unsharded
    copies mid-step, so the sharded LoRA weights stay frozen (their adapter then saves empty). This sets only
    what the layers' forward reads."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    were = [getattr(m, attribute) for m in layers]
    for m in layers:
        setattr(m, attribute, value)
    try:
        yield
    finally:
        for m, was in zip(layers, were):
            setattr(m, attribute, was)


def reference_switch(model):
    """The reference model for the block: the starting adapter where the run started from one
    (model.init_adapter), else the base (the PEFT model with its adapter off; a model without LoRA layers is its
    own reference). DPO's, GRPO's KL term's, and distillation's teacher on the student's base."""
    if REFERENCE in getattr(model, "peft_config", {}):
        return tuner_layers_set(model, "_active_adapter", [REFERENCE])
    return tuner_layers_set(model, "_disable_adapters", True)


def reference_logps(model, input_ids: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """The same log-probs from the reference model, without gradients."""
    with torch.no_grad(), reference_switch(model):
        return sequence_logps(model, input_ids, labels, chunk_tokens)


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0) -> torch.Tensor:
    """Each pair's loss, from h = its chosen answer's log-ratio to the reference minus its rejected one's."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":  # label_smoothing: conservative DPO, a share of the labels assumed flipped
        return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * h)
    raise ValueError(f"dpo.loss_type={loss_type}: use sigmoid, ipo or hinge")


def real_pairs(batch: dict) -> torch.Tensor:
    """Which rows are pairs to learn from: a stand-in row (app/data/stream.py's without_targets) has no
    target token and counts nowhere."""
    return (batch["chosen_labels"] != IGNORE_INDEX).any(-1)


def global_pair_count(micro_batches: list[dict]) -> torch.Tensor:
    """P for this step: one all-reduce of a scalar, before any forward pass."""
    count = sum(real_pairs(b).sum() for b in micro_batches).to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(count)
    return count


def metric_sums(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float,
                real: torch.Tensor | None = None) -> torch.Tensor:
    """The METRICS of a micro-batch, summed over its (`real`) pairs (all-reduce, then divide by the pairs)."""
    chosen = beta * (policy_chosen - ref_chosen).detach()
    rejected = beta * (policy_rejected - ref_rejected).detach()
    per_pair = torch.stack([chosen, rejected, (chosen > rejected).to(chosen.dtype), chosen - rejected,
                            policy_chosen.detach(), policy_rejected.detach()])
    return (per_pair.double() * (1 if real is None else real)).sum(-1)


def metrics_from_sums(sums: torch.Tensor, pairs: float) -> dict[str, float]:
    return dict(zip(METRICS, (sums / pairs).tolist()))


def scaled_micro_batch_dpo_loss(model, batch: dict, global_pairs: torch.Tensor, world_size: int, beta: float,
                                loss_type: str = "sigmoid", label_smoothing: float = 0.0, chunk_tokens: int = 0):
    """What one rank backpropagates for one micro-batch of pairs; returns (that loss, its unscaled loss sum,
    its METRICS summed over its pairs). The reference's forward runs first, without gradients."""
    ids, labels = concatenated(batch)
    rows, real = len(batch["chosen_input_ids"]), real_pairs(batch)
    ref_chosen, ref_rejected = reference_logps(model, ids, labels, chunk_tokens).split(rows)
    policy_chosen, policy_rejected = sequence_logps(model, ids, labels, chunk_tokens).split(rows)
    loss_sum = (dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, loss_type,
                           label_smoothing) * real).sum()
    sums = metric_sums(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, real)
    return loss_sum * (world_size / global_pairs), loss_sum.detach(), sums

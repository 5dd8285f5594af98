"""Causal-LM loss, normalised by the number of target tokens in the whole global batch.

Each micro-batch contributes `sum of token losses / N`, where N counts the unmasked tokens over
every micro-batch of every rank in this optimizer step. Summed over micro-batches and ranks that is
exactly the mean over the global batch, whatever the worker count or accumulation split, so one
worker and two workers given the same global batch take the same step. FSDP averages gradients over
ranks, so the loss a rank backpropagates is scaled by the world size to turn that average into the sum.

The cross-entropy is computed from the final hidden states in chunks of `chunk_tokens` positions: the
logits of one chunk exist at a time (fp32 logits of seq 2048 x micro 2 x a 128k vocabulary would be
2 GiB), and the gradient for the hidden states is computed with them, so backward keeps no logits either.
Only target positions go through the head: a prompt's or a pad's logits weigh nothing in the loss, and on chat
data they are about half the positions, the head a fifth of a 100M model's compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.data.chat import IGNORE_INDEX
from app.errors import warn_once
from app.model.packing_probe import packed_row_inputs


def target_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry loss: labels are shifted by one, so the first position never does."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def global_target_tokens(micro_batches: list[dict]) -> torch.Tensor:
    """N for this step: one all-reduce of a scalar, before any forward pass."""
    count = sum(target_token_count(b["labels"]) for b in micro_batches).to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(count)
    return count


def scaled_micro_batch_loss(model, batch: dict, global_tokens: torch.Tensor, world_size: int,
                            chunk_tokens: int = 0):
    """What one rank backpropagates for one micro-batch; returns (that loss, its unscaled token sum)."""
    token_sum = summed_token_loss(model, batch, chunk_tokens)
    return token_sum * (world_size / global_tokens), token_sum.detach()


def scaled_block_losses(model, batch: dict, global_tokens: torch.Tensor, world_size: int, block_rows: list[int],
                        chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled_micro_batch_loss for a micro-batch of blocks of rows, `block_rows[i]` rows each (adapters sharing it,
    each its own rows: app/model/row_routing.py), block i's loss normalised by `global_tokens[i]`; returns (the
    loss, each block's unscaled token sum)."""
    losses = token_losses(model, batch, chunk_tokens).flatten()
    rows = sum(block_rows)
    if losses.numel() % rows:  # rows laid end to end (flash): the first position has no loss; every row's first
        losses = F.pad(losses, (1, 0))  # label is masked, so no block's loss reaches into the next
    per_row = losses.numel() // rows
    block_sums = torch.stack([block.sum() for block in losses.split([r * per_row for r in block_rows])])
    return (block_sums * (world_size / global_tokens)).sum(), block_sums.detach()  # each block's scale, as alone


def summed_token_loss(model, batch: dict, chunk_tokens: int = 0) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the unmasked tokens of one micro-batch; with
    `chunk_tokens`, computed in chunks where the model's output head allows it."""
    return token_losses(model, batch, chunk_tokens).sum()


def token_losses(model, batch: dict, chunk_tokens: int = 0) -> torch.Tensor:
    """Next-token cross-entropy at every position after the first, 0 where the label is masked: [rows, length - 1]
    in fp32 (packed rows under a FlashAttention kernel: one row laid end to end). With `chunk_tokens`, computed in
    chunks where the model's output head allows it."""
    return _position_losses(model, batch, chunk_tokens)[0]


def sampled_token_logps(model, batch: dict, chunk_tokens: int = 0,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each label under the logits divided by `temperature`, 0 where the label is masked;
    the entropy of that distribution at each target position, not differentiated): [rows, length - 1] each, in fp32.
    What a sampled answer's tokens had under the policy that sampled them (app/train/grpo.py)."""
    losses, entropy = _position_losses(model, batch, chunk_tokens, temperature, with_entropy=True)
    return -losses, entropy


def _position_losses(model, batch: dict, chunk_tokens: int, temperature: float = 1.0, with_entropy: bool = False):
    batch = _as_one_sequence_for_flash(model, batch)
    lm = _causal_lm(model)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch.get("position_ids"), "use_cache": False}
    if inputs["position_ids"] is not None:  # packed rows: what keeps their records apart in this model
        inputs |= packed_row_inputs(lm.config, inputs["position_ids"], lm.get_input_embeddings().weight.dtype)
    labels = batch["labels"][:, 1:]
    head = chunkable_head(model) if chunk_tokens else None
    softcap = getattr(lm.config.get_text_config(), "final_logit_softcapping", None)
    hidden = _head_input(model, head, inputs, softcap) if head is not None else None
    if hidden is None:
        logits = model(**inputs).logits[:, :-1].float()
        logits = logits / temperature if temperature != 1.0 else logits
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="none").view(labels.shape)
        if not with_entropy:
            return losses, None
        with torch.no_grad():
            log_probs = torch.log_softmax(logits, dim=-1)
            return losses, -(log_probs.exp() * log_probs).sum(-1)
    losses, entropy = ChunkedLinearCrossEntropy.apply(hidden[:, :-1].flatten(0, 1), head.weight, labels.flatten(),
                                                      chunk_tokens, softcap, temperature, with_entropy)
    return losses.view(labels.shape), entropy.view(labels.shape) if with_entropy else None


STAND_IN_LOGIT = 64.0  # what the head's stand-in returns: anything done to logits after the head moves it


def _head_input(model, head: nn.Linear, inputs: dict, softcap: float | None) -> torch.Tensor | None:
    """The hidden states the output head is given, from the model's own forward (FSDP's hooks run, the root's
    weights stay gathered for backward) with a stand-in for the head that keeps its input and makes no logits.

    None, warned once, where the chunked loss would not give the model's loss: the head is not called once
    on [batch, length, hidden] (a forward that reads its weight directly), or, checked at a model class's
    first call, the model changes the head's output in a way the chunked loss does not repeat (a logit
    scale, a cap other than Gemma's softcapping). That class takes the plain loss from then on."""
    seen = []

    def stand_in(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden)
        return hidden.new_full((*hidden.shape[:-1], 1), STAND_IN_LOGIT)

    own_forward = head.__dict__.get("forward")
    head.forward = stand_in
    try:
        logits = model(**inputs).logits
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
    lm_class = type(_causal_lm(model))
    if len(seen) != 1 or seen[0].shape[:2] != inputs["input_ids"].shape:
        problem = "does not hand its output head the final hidden states once per forward"
    elif lm_class not in _HEAD_CHECKED and not _logits_are_the_heads(logits, softcap, inputs["input_ids"].shape):
        problem = "changes the output head's logits in a way the chunked loss does not (a scale or cap)"
    else:
        _HEAD_CHECKED.add(lm_class)
        return seen[0]
    _PLAIN_LOSS.add(lm_class)
    warn_once(f"train.loss_chunk_tokens: {lm_class.__name__} {problem}; it takes the plain loss (full logits)")
    return None


def _logits_are_the_heads(logits: torch.Tensor, softcap: float | None, shape: torch.Size) -> bool:
    expected = torch.tensor(STAND_IN_LOGIT)
    if softcap:
        expected = torch.tanh(expected / softcap) * softcap
    return (logits is not None and logits.shape == (*shape, 1)
            and torch.allclose(logits.float().cpu(), expected, rtol=4 * torch.finfo(logits.dtype).eps, atol=0))


_HEAD_CHECKED: set[type] = set()  # CausalLM classes whose logits are their head's output, softcapped or not
_PLAIN_LOSS: set[type] = set()  # and those whose loss the chunked loss does not give


def _as_one_sequence_for_flash(model, batch: dict) -> dict:
    """FlashAttention kernels read packed records from restarting position ids only in a batch of one
    row (transformers' varlen path): packed rows are laid end to end there. Exact: every packed row starts
    at position 0 and its first label is masked, so no loss crosses from one row into the next."""
    kernel = getattr(_causal_lm(model).config, "_attn_implementation", None) or ""
    if batch.get("position_ids") is None or "flash" not in kernel or len(batch["input_ids"]) == 1:
        return batch
    return batch | {k: batch[k].reshape(1, -1) for k in ("input_ids", "labels", "position_ids")}


def _causal_lm(model) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# Config fields that change logits after the head (a scale or multiplier); a model with any of them set
# takes the plain loss. Softcapping is applied by the chunked loss itself.
LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier_scale",
                    "logit_multiplier")


def chunkable_head(model) -> nn.Linear | None:
    """The output projection when logits are `hidden @ weight.T` (softcapped or not); None where the model
    does more (a bias, a logit scale or multiplier, a LoRA-adapted head) or was found to (_head_input):
    those take the plain loss."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None or type(lm) in _PLAIN_LOSS:
        return None
    configs = {id(c): c for c in (lm.config, lm.config.get_text_config())}.values()
    if any(getattr(c, name, None) not in (None, 1, 1.0) for c in configs for name in LOGIT_TRANSFORMS):
        return None
    return head


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(hidden @ weight.T [softcapped] / temperature, labels) at each position (0 where masked), one
    chunk of target positions at a time, and (not differentiated) each target position's entropy when asked (0
    where masked). The gradients
    are computed in the forward, chunk by chunk, and kept (the size of `hidden` and `weight`) instead of the
    logits; backward weighs each position's by its loss's gradient (the loss scale under a sum, each sequence's
    DPO weight under DPO, each token's GRPO weight). The weight's gradient, summed in the forward, takes one
    weight for every position: the LoRA recipes never train the head's base weight."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens: int, softcap: float | None, temperature: float = 1.0,
                with_entropy: bool = False):
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        losses = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(losses)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        targets = (labels != IGNORE_INDEX).nonzero()[:, 0]  # the positions the loss counts: the rest stay 0
        for start in range(0, len(targets), chunk_tokens):
            chunk = targets[start:start + chunk_tokens]
            h, chunk_losses = hidden[chunk], losses[chunk]
            chunk_entropy = entropy[chunk] if with_entropy else None
            grad = _chunk_loss(h, weight, labels[chunk], softcap, temperature, chunk_losses, chunk_entropy,
                               want_hidden or want_weight)
            losses[chunk] = chunk_losses
            if with_entropy:
                entropy[chunk] = chunk_entropy
            if grad is not None:
                grad = grad.to(hidden.dtype)
                if want_hidden:
                    grad_hidden[chunk] = grad @ weight
                if want_weight:
                    grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(entropy)
        return losses, entropy

    @staticmethod
    def backward(ctx, grad_losses, grad_entropy):
        grad_hidden, grad_weight = ctx.saved_tensors
        # each position's weight (the loss scale, world size / N) in fp32: rounded to bf16 it is up to 0.4% off
        scale = grad_losses.float()[:, None]
        if grad_weight is not None:
            if not torch.equal(grad_losses, grad_losses[:1].expand_as(grad_losses)):
                raise NotImplementedError("train.loss_chunk_tokens: a trained output head needs one loss weight "
                                          "for every position; set train.loss_chunk_tokens=0")
            grad_weight = (grad_weight * grad_losses[0]).to(ctx.weight_dtype)
        return (None if grad_hidden is None else (grad_hidden.float() * scale).to(grad_hidden.dtype),
                grad_weight, None, None, None, None, None)


def _chunk_loss(h, weight, y, softcap: float | None, temperature: float, losses: torch.Tensor,
                entropy: torch.Tensor | None, want_grad: bool) -> torch.Tensor | None:
    """One chunk of ChunkedLinearCrossEntropy (target positions only): its losses (and entropies) written in
    place; returns the gradient of each position's loss with respect to its logits before softcapping (None
    unless `want_grad`)."""
    logits = (h @ weight.T).float()  # what the model's head gives, then the fp32 cast the plain loss makes
    if softcap:
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    if temperature != 1.0:
        logits = logits / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    losses.copy_(log_norm - logits.gather(1, y[:, None])[:, 0])
    if entropy is not None:  # H = logsumexp(z) - E_p[z]
        entropy.copy_(log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1))
    if not want_grad:
        return None
    grad = logits.sub_(log_norm[:, None]).exp_()  # softmax, in place of the logits
    grad[torch.arange(len(y), device=y.device), y] -= 1
    if temperature != 1.0:
        grad /= temperature
    if softcap:
        grad *= 1 - capped * capped
    return grad

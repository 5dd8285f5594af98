"""The attention the engine's forward runs: registered with transformers' AttentionInterface as `engine_slots`, so
any model whose attention layers call the interface (Llama, Qwen, Mistral, Gemma, Phi, ...) runs through it
unchanged, its projections, rotary embedding and norms its own.

A layer hands it the step's new queries, keys and values (one row of every token of the step, rotary applied):
it writes the keys and values into their slots of the cache (app/engine/cache.py), then computes each decoding
token's attention over its slot (all of them at once, grouped-query heads without copying the keys per head), and
each prompt chunk's causal attention over its slot's positions up to it. A layer's sliding window and logit
soft-cap (Gemma 2) are honoured. Called without a step (a plain forward of the same model), it is transformers'
SDPA attention.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.engine.layout import Segment, StepLayout

NAME = "engine_slots"


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                   scaling: float | None = None, dropout: float = 0.0, **kwargs):
    step: StepLayout | None = kwargs.pop("engine_step", None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scaling = query.shape[3] ** -0.5 if scaling is None else scaling
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    queries = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    keys, values = step.cache.write(module.layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1),
                                    step.token_slots, step.position_ids[0])
    out = queries.new_empty(queries.shape)
    if step.decoding:  # the first tokens of the step
        out[:step.decoding] = decoded(queries[:step.decoding], keys, values, step, scaling, window, softcap)
    for segment in step.segments:
        out[segment.first:segment.first + segment.length] = prefilled(
            queries[segment.first:segment.first + segment.length], keys, values, segment, scaling, window, softcap)
    return out[None], None  # [1, tokens, heads, head_dim], as the model reshapes it


def decoded(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepLayout, scaling: float,
            window: int | None, softcap: float | None) -> torch.Tensor:
    """Each decoding token's attention over its slot: queries [n, heads, d] -> [n, heads, d]. The slots' first
    `step.decode_width` positions are read in place (a compact view: no copy of the cache)."""
    n, heads, head_dim = queries.shape
    k, v = keys[step.decode_rows, :, :step.decode_width], values[step.decode_rows, :, :step.decode_width]
    q = queries.reshape(n, k.shape[1], heads // k.shape[1], head_dim).to(k.dtype)  # [n, kv_heads, groups, d]
    if not softcap:  # one fused kernel (about 2x the two products and softmax below on CPUs)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=step.decode_mask(window, q.dtype), scale=scaling)
        return out.reshape(n, heads, head_dim).to(queries.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling)  # [n, kv_heads, groups, width]
    scores = torch.tanh(scores / softcap) * softcap
    scores += step.decode_mask(window, scores.dtype)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(weights, v).reshape(n, heads, head_dim).to(queries.dtype)


def prefilled(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segment: Segment, scaling: float,
              window: int | None, softcap: float | None) -> torch.Tensor:
    """A prompt chunk's causal attention over its slot's positions up to each token: [length, heads, d]."""
    end = segment.start + segment.length
    q = queries.transpose(0, 1)[None].to(keys.dtype)  # [1, heads, length, d]
    k, v = keys[segment.slot, :, :end][None], values[segment.slot, :, :end][None]
    if segment.start == 0 and window is None and not softcap:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        return out[0].transpose(0, 1).to(queries.dtype)
    rows = torch.arange(segment.start, end, device=q.device)[:, None]
    columns = torch.arange(end, device=q.device)[None]
    attends = columns <= rows
    if window is not None:
        attends &= columns > rows - window
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    weights = scores.masked_fill(~attends, float("-inf")).softmax(dim=-1).to(v.dtype)
    return torch.matmul(weights, v)[0].transpose(0, 1).to(queries.dtype)


AttentionInterface.register(NAME, slot_attention)

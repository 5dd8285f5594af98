"""Attention over packed rows on CPUs, one record at a time.

A packed row keeps its records apart with a block-causal mask: SDPA then computes the whole row's attention (a
512-token row of 34-token records: every score of 512 x 512, of which ~7% are kept) and masks the rest away, a
quarter of the step on a CPU. GPUs have a varlen kernel that skips the masked blocks (FlashAttention's, which
app/train/loss.py feeds packed rows to); CPUs do not, so this kernel runs causal attention on each record's own
slice of the row, which is exactly what the mask allows. A short record's attention is two matmuls and a softmax
(in fp32, as transformers' eager attention): the CPU's flash kernel costs 2-3x that below ~200 tokens
(docs/performance.md); a longer one takes SDPA's kernel, which keeps no [length, length] scores. Rows of at most
WHOLE_ROW_UP_TO tokens attend whole under the block-causal mask, by the same matmuls: the few wasted scores cost
less than a loop over every record of the micro-batch.

Registered with transformers as `sdpa_segments` (its masks are SDPA's): it takes the record lengths as the
`packed_segments` argument of the model's forward and, without them or where a layer's attention is more than
causal (a sliding window, softcapping, sinks, a KV cache, compiled code), is transformers' SDPA with the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENTS_KERNEL = "sdpa_segments"
MATMUL_UP_TO = 192  # tokens: a record this short has its scores computed by matmuls; longer ones by SDPA
WHOLE_ROW_UP_TO = 64  # tokens: rows this short attend whole under the mask, by matmuls (a few ops for every row)


def segment_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """Each row's record lengths, from its restarting position ids (padding ends a row as a record of its own)."""
    lengths = []
    for row in position_ids.cpu():
        starts = (row == 0).nonzero()[:, 0].tolist() + [len(row)]
        lengths.append([end - start for start, end in zip(starts, starts[1:])])
    return lengths


def sdpa_by_segment(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    packed_segments: list[list[int]] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query, key, value [batch, heads, length, head dim]; returns
    [batch, length, heads, head dim]."""
    short = query.shape[2] <= WHOLE_ROW_UP_TO
    if packed_segments is None or not _plainly_causal(module, query, key, kwargs) or (short and dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if short:
        return masked_attention(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    rows = []
    # split, not sliced: a slice's backward writes a zero tensor of the whole input for each record, a split's
    # backward joins the records' gradients once
    for lengths, *row in zip(packed_segments, query.split(1), key.split(1), value.split(1), strict=True):
        parts = [causal_attention(q, k, v, dropout, scaling)
                 for q, k, v in zip(*(tensor.split(lengths, dim=2) for tensor in row), strict=True)]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None) -> torch.Tensor:
    """Whole rows' attention under their mask (bool, True where a position attends; additive; or None: causal) by
    matmuls and an fp32 softmax, [batch, heads, length, head dim]; a query that attends nowhere (padding) gets
    the mean of the values, as transformers' eager attention gives it."""
    length = query.shape[2]
    scores = ((query @ key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)).float()
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    lowest = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask.float()
    return torch.softmax(scores, dim=-1).to(value.dtype) @ value


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
                     scaling: float | None) -> torch.Tensor:
    """One record's causal attention, [1, heads, length, head dim]."""
    length = query.shape[2]
    if length > MATMUL_UP_TO or dropout:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    scores = (query @ key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
    return torch.softmax(scores.float().masked_fill(future, float("-inf")), dim=-1).to(value.dtype) @ value


def _plainly_causal(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> bool:
    """Whether the layer's attention is causal within a record and nothing more (no window, chunks, caps, sinks
    or cache): what the slices compute."""
    config = getattr(module, "config", None)
    window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    full = not layer_types or layer is None or layer_types[layer] == "full_attention"
    extras = ("softcap", "s_aux", "sinks", "position_bias", "cache")
    return (query.shape[2] == key.shape[2] and getattr(module, "is_causal", True) and not window and full
            and not getattr(config, "attention_chunk_size", None) and all(kwargs.get(n) is None for n in extras)
            and not torch.compiler.is_compiling())


def attends_per_record(model_cfg, device: torch.device) -> bool:
    """Whether packed rows of this model section train with this kernel on `device` (uncompiled layers on SDPA,
    the kernel transformers picks when model.attn_implementation is unset): what model.compile=auto weighs."""
    return device.type == "cpu" and model_cfg.attn_implementation is None


def use_segments_on_cpu(model: torch.nn.Module) -> None:
    """Switch a CPU model that runs transformers' SDPA (and can switch its kernel) to `sdpa_segments`."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa" and model._can_set_attn_implementation():
        model.set_attn_implementation(SEGMENTS_KERNEL)


AttentionInterface.register(SEGMENTS_KERNEL, sdpa_by_segment)
AttentionMaskInterface.register(SEGMENTS_KERNEL, sdpa_mask)

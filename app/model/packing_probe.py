"""Does a model keep packed records apart? A tiny random copy of its architecture decides, not a list.

Packed rows carry each record's own position ids (0, 1, ...) and no attention mask. A model that hands
those positions to transformers' mask builder attends within each record only; one that does not (Falcon,
OPT, ...) sees a single causal sequence, and a record attends to the records before it in its row. The
probe runs a packed row of three short records and each record alone through a 2-layer copy of the
model's config (random weights, fp32, on the CPU: milliseconds) and compares each record's loss. It tells
the training step how to feed packed rows:

- "positions": the restarting position ids alone keep records apart;
- "mask": they do so with, besides them, the 4-D block-diagonal causal mask transformers builds from such
  positions (for models that take a prepared 4-D mask but derive none from positions);
- None: neither does (recurrent state, ALiBi taken from a 2-D mask, a model that fails on packed inputs):
  the driver refuses `data.packing`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.errors import first_line
from app.model.segment_attention import SEGMENTS_KERNEL, segment_lengths

# Records isolated: a packed record's loss within this relative gap of its loss alone (fp32 rounding is ~1e-7).
ISOLATED_GAP = 1e-5
RECORD_LENGTHS = (6, 9, 5)
# Size fields of configs (or aliases through their attribute_map), each lowered to this where it is larger.
SMALL_SIZES = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 512,
    "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "rotary_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "index_n_heads": 4, "index_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}
MAX_PROBE_PARAMETERS = 50_000_000  # a config that stays larger than this once shrunk is not probed


@dataclass(frozen=True)
class PackingIsolation:
    feed: str | None  # "positions", "mask", or None: packed records cannot be kept apart
    gap: float  # with positions alone: the largest relative gap of a packed record's loss to its loss alone
    problem: str | None = None  # why the probe could not tell (the copy does not build, or packed inputs fail)


def small_config_values(config) -> dict:
    """The config's values with its size fields lowered (SMALL_SIZES), per-layer lists cut to the new layer
    count, token ids kept inside the smaller vocabulary, and sub-configs (text, vision) shrunk alike."""
    values = config.to_dict()
    aliases = getattr(config, "attribute_map", {})
    layers_key = aliases.get("num_hidden_layers", "num_hidden_layers")
    old_layers = values.get(layers_key)
    for key, small in SMALL_SIZES.items():
        name = aliases.get(key, key)
        if type(values.get(name)) is int and values[name] > small:
            values[name] = small
    heads, kv_heads = (aliases.get(key, key) for key in ("num_attention_heads", "num_key_value_heads"))
    if type(values.get(heads)) is int and type(values.get(kv_heads)) is int and values[heads] % values[kv_heads]:
        values[kv_heads] = math.gcd(values[heads], values[kv_heads])  # 9 heads / 3 shrunk to 4 / 3: grouped still
    layers, vocab = values.get(layers_key), values.get(aliases.get("vocab_size", "vocab_size"))
    for key, value in list(values.items()):
        sub = getattr(config, key, None)
        if sub is not config and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            values[key] = small_config_values(sub)
        elif isinstance(value, list) and layers and old_layers and len(value) == old_layers:
            values[key] = value[:layers]
        elif isinstance(value, dict) and layers and value and all(isinstance(k, int) for k in value):
            values[key] = {k: v for k, v in value.items() if k < layers}
        elif key.endswith("token_id") and type(value) is int and vocab and value >= vocab:
            values[key] = 1
    return values


def tiny_config(config):
    """A 2-layer, narrow copy of `config`: same class, same options (ALiBi, parallel attention, ...)."""
    return type(config).from_dict(small_config_values(config))


def block_causal_mask(config, position_ids: torch.Tensor, dtype: torch.dtype):
    """The mask transformers builds for `config`'s attention kernel from restarting position ids: causal
    within each record, nothing across (bool for SDPA, additive in `dtype` for eager attention)."""
    from transformers.masking_utils import create_causal_mask

    shape_only = torch.empty(*position_ids.shape, 0, dtype=dtype, device=position_ids.device)  # batch, length, dtype
    return create_causal_mask(config=config, inputs_embeds=shape_only, attention_mask=None, past_key_values=None,
                              position_ids=position_ids)


def feed_inputs(feed: str, config, position_ids: torch.Tensor, dtype: torch.dtype) -> dict:
    """What a packed row needs besides its input ids and position ids, for `feed` (and the record lengths for the
    CPU's per-record kernel, app/model/segment_attention.py)."""
    inputs = {"attention_mask": block_causal_mask(config, position_ids, dtype)} if feed == "mask" else {}
    if getattr(config, "_attn_implementation", None) == SEGMENTS_KERNEL:
        inputs["packed_segments"] = segment_lengths(position_ids)
    return inputs


MASK_KERNELS = (None, "sdpa", "eager", SEGMENTS_KERNEL)  # attention kernels that take a prepared 4-D mask tensor


def probe_kernel(attn_implementation: str | None) -> str | None:
    """The kernel the probe runs on the CPU: eager where the model uses it, transformers' default (SDPA where
    the model has it) otherwise; flash kernels read packed rows from the same position ids."""
    return "eager" if attn_implementation == "eager" else None


_probed: dict[str, PackingIsolation] = {}


def packing_isolation(config, attn_implementation: str | None = None,
                      trust_remote_code: bool = False) -> PackingIsolation:
    """How packed rows of a model with this config keep their records apart; probed once per config and
    kernel in a process (the driver's check, then each worker's first packed micro-batch: same answer)."""
    kernel = probe_kernel(attn_implementation)
    key = f"{type(config).__module__}.{type(config).__qualname__}/{kernel}/{config.to_json_string()}"
    if key not in _probed:
        _probed[key] = _probe(config, kernel, trust_remote_code)
    return _probed[key]


def packing_problem(config, attn_implementation: str | None = None, trust_remote_code: bool = False) -> str | None:
    """Why packed rows of this model would not train as if each record were alone, as one line naming
    data.packing; None when they do."""
    isolation = packing_isolation(config, attn_implementation, trust_remote_code)
    name = config.model_type
    if isolation.problem:
        return (f"data.packing: cannot tell whether {name} isolates packed records ({isolation.problem}); "
                "set data.packing=false")
    if isolation.feed is None:
        return (f"data.packing: {name} does not isolate packed records (a record's loss differs by "
                f"{isolation.gap:.2%} from its loss alone); set data.packing=false")
    if isolation.feed == "mask" and attn_implementation not in MASK_KERNELS:
        return (f"data.packing: {name} isolates packed records only with a 4-D attention mask, which "
                f"model.attn_implementation={attn_implementation} does not take; use sdpa or eager, or set "
                "data.packing=false")
    return None


_feed_of_loaded: dict[int, tuple] = {}  # id(config) -> (config, feed): decided once per loaded model


def packed_row_inputs(config, position_ids: torch.Tensor, dtype: torch.dtype) -> dict:
    """The extra inputs of a packed micro-batch for the loaded model of `config` (probed on its first
    packed micro-batch; later ones look the answer up, with no work on the step's path)."""
    entry = _feed_of_loaded.get(id(config))
    if entry is None or entry[0] is not config:
        kernel = getattr(config, "_attn_implementation", None)
        problem = packing_problem(config, kernel, trust_remote_code=bool(getattr(config, "auto_map", None)))
        if problem:  # the driver refuses such a model before any worker starts
            raise RuntimeError(problem)
        entry = _feed_of_loaded[id(config)] = (config, packing_isolation(config, kernel).feed)
    return feed_inputs(entry[1], config, position_ids, dtype)


def _probe(config, kernel: str | None, trust_remote_code: bool) -> PackingIsolation:
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # a tiny copy's notes (fallback kernels, config warnings) are not the user's
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # leaves the run's RNG as it was
            warnings.simplefilter("ignore")
            try:
                model = _tiny_model(config, kernel, trust_remote_code)
            except Exception as e:
                return PackingIsolation(None, float("inf"), f"a 2-layer copy does not build: {_failure(e)}")
            with torch.no_grad():
                return _isolation(model)
    finally:
        logging.set_verbosity(verbosity)


def _tiny_model(config, kernel: str | None, trust_remote_code: bool):
    """A random fp32 model of tiny_config(config) on the CPU (sized on the meta device first)."""
    from transformers import AutoModelForCausalLM

    small = tiny_config(config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(small, trust_remote_code=trust_remote_code)
    size = sum(p.numel() for p in skeleton.parameters())
    if size > MAX_PROBE_PARAMETERS:
        raise ValueError(f"it still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    with torch.device("cpu"):
        return AutoModelForCausalLM.from_config(small, dtype=torch.float32, attn_implementation=kernel,
                                                trust_remote_code=trust_remote_code).eval()


def _isolation(model) -> PackingIsolation:
    vocab = model.get_input_embeddings().weight.shape[0]
    records = [torch.randint(min(4, vocab - 1), vocab, (n,), generator=torch.Generator().manual_seed(n))
               for n in RECORD_LENGTHS]
    try:
        alone = [_token_losses(model, r[None], {})[0].sum() for r in records]
    except Exception as e:
        return PackingIsolation(None, float("inf"), f"a record alone fails: {_failure(e)}")
    row = torch.cat(records)[None]
    positions = torch.cat([torch.arange(n) for n in RECORD_LENGTHS])[None]
    gaps, problem = {}, None
    for feed in ("positions", "mask"):
        try:
            losses = _token_losses(model, row, {"position_ids": positions}
                                   | feed_inputs(feed, model.config, positions, torch.float32))[0]
        except Exception as e:
            gaps[feed], problem = float("inf"), problem or f"packed rows fail: {_failure(e)}"
            continue
        starts = torch.tensor((0, *RECORD_LENGTHS)).cumsum(0).tolist()
        packed = [losses[s:s + n - 1].sum() for s, n in zip(starts, RECORD_LENGTHS)]
        gaps[feed] = max(abs(p - a).item() / max(abs(a).item(), 1e-12) for p, a in zip(packed, alone))
        if gaps[feed] <= ISOLATED_GAP:
            return PackingIsolation(feed, gaps["positions"])
    return PackingIsolation(None, gaps["positions"], problem if gaps["positions"] == float("inf") else None)


def _token_losses(model, input_ids: torch.Tensor, extra: dict) -> torch.Tensor:
    """Per-position loss of predicting the next token, as the step computes it (no labels to the model)."""
    logits = model(input_ids=input_ids, use_cache=False, **extra).logits.float()
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")


def _failure(e: Exception) -> str:
    return f"{type(e).__name__}: {first_line(e)[:160]}"

"""Predicted memory of one worker, from the model's config alone (no weights), before any cluster time.

Parameter counts are exact: the PEFT LoRA model is built on the meta device. The rest follows FSDP2's
layout: every stored tensor is split over the `shard` ranks of its mesh dimension; during forward and
backward one decoder layer (and the next, prefetched) is all-gathered in `fsdp.param_dtype`, the root
unit (embeddings, final norm, LM head) stays gathered from forward to backward, and without
`reshard_after_forward` every layer stays gathered until its backward. Activations are an estimate:
with activation checkpointing each layer keeps its input and one layer at a time is recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from app.config.distill import teacher_model
from app.config.objectives import objective_of
from app.config.schema import FinetuneConfig
from app.config.sections import ModelSection
from app.engine.cache import SlotCache
from app.engine.merging import lora_layers
from app.model.hardware import has_fast_bf16
from app.model.quantization import NF4_BYTES_PER_PARAM, quantizable_linears
from app.plan.dtypes import planned_dtypes

GiB = 2**30
TEACHER = "distillation teacher (its weights' share or adapter)"
TEACHER_LOSS = "distillation loss (full-vocabulary logits)"
ACTIVATIONS = "activations (estimate)"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class MemoryPlan:
    workers: int
    shard: int
    base_params: int
    lora_params: int
    device: dict[str, float] = field(default_factory=dict)  # component -> bytes on the accelerator (or RAM on CPU)
    host: dict[str, float] = field(default_factory=dict)  # offloaded components
    model_config: object = None  # the transformers config: what activations of other batch shapes are planned from
    compute_bytes: int = 4
    num_layers: int = 0
    rollout_actor: dict[str, float] = field(default_factory=dict)  # component -> bytes on one rollout actor's device
    rollout_actor_host: dict[str, float] = field(default_factory=dict)  # and in its host memory

    @property
    def rollout_actor_total(self) -> float:
        """What one rollout actor holds on its device (on a CPU actor, its host memory holds the host part too)."""
        return sum(self.rollout_actor.values())

    @property
    def device_total(self) -> float:
        return sum(self.device.values())


def count_parameters(cfg: FinetuneConfig, config_file: str | None = None):
    """(PEFT model on the meta device, base parameter count, LoRA parameter count)."""
    from app.model.build import build_meta_lora_model

    model = build_meta_lora_model(cfg.model, cfg.trained_lora(), cfg.train.seed, config_file=config_file)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, base, lora


def plan_memory(cfg: FinetuneConfig, config_file: str | None = None) -> MemoryPlan:
    from app.model.sharding import decoder_layers

    dtypes = planned_dtypes(cfg, cfg.scaling.use_gpu or has_fast_bf16(torch.device("cpu")))
    model, base, lora = count_parameters(cfg, config_file)
    shard = cfg.shard_group_size
    stored, compute = (DTYPE_BYTES[name] for name in dtypes)
    layers = decoder_layers(model)
    quantized = nf4_params(layers) if cfg.model.quantization == "nf4" else [0]
    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    root_params = base + lora - sum(p.numel() for layer in layers for p in layer.parameters())
    plan = MemoryPlan(cfg.scaling.worker_counts[0], shard, base, lora,  # elastic: the smallest group
                      model_config=model.config, compute_bytes=compute, num_layers=len(layers))

    # NF4 weights: on a one-rank shard group FSDP2 leaves them alone (not sharded, gathered or offloaded)
    nf4_bytes = sum(quantized) * NF4_BYTES_PER_PARAM
    whole_nf4 = shard == 1 and nf4_bytes > 0
    base_bytes = (base - sum(quantized)) * stored + (0 if whole_nf4 else nf4_bytes)
    state = {"parameters (sharded, stored dtype)": (base_bytes + lora * 4) / shard,  # NF4 bytes where quantized
             "LoRA gradients (sharded, fp32)": lora * 4 / shard,
             "AdamW state (sharded, 2 x fp32)": 2 * lora * 4 / shard}
    (plan.host if cfg.fsdp.cpu_offload else plan.device).update(state)
    if whole_nf4:
        plan.device["NF4 weights (1-rank groups: not sharded)"] = nf4_bytes
    gathered_layers = 2 if cfg.fsdp.reshard_after_forward else len(layers)
    # gathered NF4 layers stay 4-bit; each linear dequantizes as it runs: int64 codes, a few stored-dtype
    # temporaries, the compute-dtype copy
    layer_bytes = (layer_params - max(quantized)) * compute + (0 if whole_nf4 else max(quantized) * NF4_BYTES_PER_PARAM)
    dequantized = max(quantized) and max(linear.weight.numel() for layer in layers
                                         for linear in quantizable_linears(layer).values()) * (8 + 3 * stored + compute)
    plan.device["all-gathered parameters (compute dtype)"] = (gathered_layers * layer_bytes + root_params * compute
                                                              + dequantized)
    plan.device[ACTIVATIONS] = activation_bytes(model.config, cfg, compute, len(layers))
    if objective_of(cfg.train).taught:
        plan.device[TEACHER] = teacher_bytes(cfg, lora / shard, shard, stored, compute)
        plan.device[TEACHER_LOSS] = teacher_loss_bytes(model.config, cfg)
    if objective_of(cfg.train).samples_online:
        plan.rollout_actor, plan.rollout_actor_host = rollout_actor_bytes(cfg, model, base, lora, stored)
    return plan


def rollout_actor_bytes(cfg: FinetuneConfig, model, base: int, lora: int,
                        stored: int) -> tuple[dict[str, float], dict[str, float]]:
    """One rollout actor, apart from the workers (its engine holds the whole base, not sharded), on its device:
    the base in the stored dtype; the policy's LoRA weights beside it (fp32), unless merged in; the KV cache of the
    answers it decodes at once (rollout.batch_rows, or its share of a step's answers and of the steps sampled ahead
    with the same adapter) at their longest; a decoding step's logits. On the host: rollout.policy=merged's
    untouched copy of every adapted weight, which each sync merges from."""
    rollout, config = cfg.rollout, model.config
    actors = 1 if rollout.workers == "auto" else rollout.workers  # auto: one until the driver sizes them
    rows = rollout.batch_rows or math.ceil(cfg.train.global_batch_size * (1 + rollout.max_staleness) / actors)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_position = config.num_hidden_layers * 2 * kv_heads * head_dim * stored
    slots, positions = slot_cache_size(rows, cfg.data.max_seq_len + rollout.max_completion_tokens)
    device = {"whole base (stored dtype)": base * stored,
              f"KV cache: {slots} slots x {positions} positions": slots * positions * per_position,
              "a decoding step's logits (fp32)": rows * config.vocab_size * 4 * 2}
    if rollout.policy == "lora":
        return device | {"policy: LoRA weights beside the base (fp32)": lora * 4}, {}
    adapted = sum(layer.get_base_layer().weight.numel() for _, layer in lora_layers(model))
    return device, {"merged policy: untouched adapted weights": adapted * stored}


def slot_cache_size(rows: int, positions: int) -> tuple[int, int]:
    """The engine's slot cache for `rows` sequences of `positions`: (slots, capacity) as the cache itself grows them
    (app/engine/cache.py; an empty cache reserves without allocating)."""
    cache = SlotCache()
    cache.reserve(rows, positions)
    return cache.slots, cache.capacity


def teacher_bytes(cfg: FinetuneConfig, lora_shard: float, shard: int, stored: int, compute: int) -> float:
    """Distillation's teacher beside the student: on the student's base its frozen adapter (sharded, fp32; counted
    at the student's size, its own shape is read later by the driver), or a teacher of its own base sharded as the
    student's is (its share in the stored dtype, and two decoder layers and its root gathered at a time in the
    compute dtype)."""
    from app.model.base import build_meta_base_model  # start-up: as plan_memory's
    from app.model.sharding import decoder_layers

    if cfg.distill.teacher is None:
        return lora_shard * 4
    teacher = build_meta_base_model(teacher_model(cfg.model, cfg.distill))
    total = sum(p.numel() for p in teacher.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(teacher)]
    return stored * total / shard + compute * (2 * max(layers) + total - sum(layers))


def teacher_loss_bytes(config, cfg: FinetuneConfig) -> float:
    """The full-vocabulary divergence over a micro-batch's prompts and answers: the teacher's logits and
    log-probabilities (fp32, no gradient) and the divergence's own intermediates."""
    tokens = cfg.train.micro_batch_size * (cfg.data.max_seq_len + cfg.rollout.max_completion_tokens)
    return tokens * config.vocab_size * 4 * 5


def with_activations_of(plan: MemoryPlan, cfg: FinetuneConfig) -> MemoryPlan:
    """The plan with the activations of `cfg`'s checkpointing and micro-batch (the rest does not change)."""
    device = plan.device | {ACTIVATIONS: activation_bytes(plan.model_config, cfg, plan.compute_bytes, plan.num_layers)}
    if TEACHER_LOSS in device:  # it grows with the micro-batch too
        device[TEACHER_LOSS] = teacher_loss_bytes(plan.model_config, cfg)
    return replace(plan, device=device)


def checkpointed_layers(model: ModelSection, num_layers: int) -> int:
    """Decoder layers activation checkpointing recomputes: every n-th (transformers' `every_n_layers`)."""
    if model.gradient_checkpointing == "auto":
        raise ValueError("model.gradient_checkpointing=auto is decided before it is planned (memory_choices.py)")
    return math.ceil(num_layers / model.checkpoint_every_n_layers) if model.gradient_checkpointing else 0


def adapters_per_pass(cfg: FinetuneConfig) -> int:
    """Adapters whose copies of a micro-batch run in one forward (train.adapters_per_micro_batch): its rows
    multiply by that."""
    shared = cfg.train.adapters_per_micro_batch
    if not cfg.adapters:
        return 1
    if shared == "auto":
        raise ValueError("train.adapters_per_micro_batch=auto is decided before it is planned (memory_choices.py)")
    return min(shared, len(cfg.adapters))


def nf4_params(layers) -> list[int]:
    """Per decoder layer, how many of its parameters model.quantization=nf4 stores as NF4."""
    return [sum(linear.weight.numel() for linear in quantizable_linears(layer).values()) for layer in layers]


def activation_bytes(config, cfg: FinetuneConfig, compute: int, num_layers: int) -> float:
    """One forward's micro-batch (a copy per adapter sharing it): saved layer inputs (checkpointing) or every
    layer's intermediates, plus the loss's share. The plain loss keeps the logits (compute dtype), their fp32 copy
    and its log-softmax, and the gradients of all three; the chunked loss holds one chunk's logits (compute dtype
    and fp32, the softmax in place) and the hidden states' gradient."""
    tokens = cfg.train.micro_batch_size * adapters_per_pass(cfg) * cfg.data.max_seq_len
    hidden, inner = config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)
    one_layer = tokens * (10 * hidden + 4 * inner) * compute  # attention (SDPA: no seq^2 term) + MLP
    checkpointed = checkpointed_layers(cfg.model, num_layers)  # keep their input; one recomputed at a time
    kept = checkpointed * tokens * hidden * compute + (num_layers - checkpointed + min(checkpointed, 1)) * one_layer
    chunk = cfg.train.loss_chunk_tokens
    if chunk:
        return kept + min(chunk, tokens) * config.vocab_size * (compute + 4) + tokens * hidden * compute
    return kept + tokens * config.vocab_size * (2 * compute + 16)


def format_plan(plan: MemoryPlan, device_memory_gb: float | None) -> str:
    layout = "every worker holds the whole model" if plan.shard == 1 else f"parameters sharded {plan.shard} ways"
    lines = [f"per worker: {plan.workers} workers, {layout}; "
             f"base {plan.base_params / 1e9:.3f} B params, LoRA {plan.lora_params / 1e6:.2f} M params"]
    for where, parts in (("device", plan.device), ("host (cpu_offload)", plan.host)):
        for name, value in parts.items():
            lines.append(f"  {where:<18} {name:<42} {value / GiB:9.3f} GiB")
    lines.append(f"  {'device':<18} {'total':<42} {plan.device_total / GiB:9.3f} GiB")
    if plan.rollout_actor:
        lines.append("each rollout actor (beside the workers; on a GPU of its own with rollout.gpus):")
        for where, parts in (("actor device", plan.rollout_actor), ("actor host", plan.rollout_actor_host)):
            for name, value in parts.items():
                lines.append(f"  {where:<18} {name:<42} {value / GiB:9.3f} GiB")
        lines.append(f"  {'actor device':<18} {'total':<42} {plan.rollout_actor_total / GiB:9.3f} GiB")
    if device_memory_gb:
        fits = plan.device_total <= 0.9 * device_memory_gb * GiB  # CUDA context, allocator fragmentation
        lines.append(f"{'fits' if fits else 'does NOT fit'} in {device_memory_gb:g} GiB per device "
                     f"(at most 90% usable: {0.9 * device_memory_gb:.1f} GiB)")
    return "\n".join(lines)

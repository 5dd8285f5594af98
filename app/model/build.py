"""The model a worker trains: the base, loaded as `model.load` says, wrapped in a PEFT LoRA adapter with its
starting weights, activation checkpointing where asked, and split into FSDP2 shards (app/model/sharding.py).

`model.load: full`: every worker loads the whole base (from_pretrained), then shards it. `sharded`: the model
is built on the meta device and each rank reads only its slices of the checkpoint (app/model/slices.py).
Both give the same weights and the same adapter for a seed.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from app.model.adapter import (
    REFERENCE,
    FrozenAdapter,
    apply_lora,
    init_lora_weights,
    load_adapter_weights,
    rows_of_loaded_model,
)
from app.model.base import build_meta_base_model, enable_activation_checkpointing, load_base_model
from app.model.quantization import quantize_layer
from app.model.segment_attention import attends_per_record, use_segments_on_cpu
from app.model.sharding import shard_group_size, shard_model
from app.model.slices import SliceReader, checkpoint_index, checkpoint_weight, materialize_from_slices, weight_files

if TYPE_CHECKING:  # importable without pydantic: benchmarks/step.py runs on a bare GPU box
    from app.config.sections import LoraSection, ModelSection


def build_lora_model(model_cfg: ModelSection, lora_cfg: LoraSection, seed: int, device="cpu",
                     reference: LoraSection | None = None, checkpointed: bool = True):
    """The whole base in memory, wrapped in LoRA with the seed's starting weights; not sharded. Activation
    checkpointing as model_cfg says (auto: decided by the driver, app/plan/memory_choices.py), unless not
    `checkpointed` (a model that only runs forward)."""
    model = apply_lora(load_base_model(model_cfg, device), lora_cfg, seed, reference)
    init_lora_weights(model, seed, rows_of_loaded_model(model))
    if checkpointed and model_cfg.gradient_checkpointing is True:
        enable_activation_checkpointing(model, model_cfg.checkpoint_every_n_layers)
    return model


def build_meta_lora_model(model_cfg: ModelSection, lora_cfg: LoraSection, seed: int, config_file: str | None = None,
                          reference: LoraSection | None = None, checkpointed: bool = True):
    """The LoRA model without weights (meta device): its shapes and names, for checks, plans and slice loading."""
    model = apply_lora(build_meta_base_model(model_cfg, config_file), lora_cfg, seed, reference)
    if checkpointed and model_cfg.gradient_checkpointing is True:
        enable_activation_checkpointing(model, model_cfg.checkpoint_every_n_layers)
    return model


def build_training_model(model_cfg, lora_cfg, fsdp_cfg, mesh, seed: int, device: torch.device,
                         init_adapter: dict[str, torch.Tensor] | None = None,
                         reference: FrozenAdapter | None = None) -> nn.Module:
    """The FSDP2-sharded PEFT LoRA model, loaded the way `model.load` says; its adapter starts from the seed,
    or from `init_adapter` (a saved adapter's weights). With `reference`, a frozen second adapter with its weights
    (DPO's starting adapter; distillation's teacher)."""
    nf4, shards = model_cfg.quantization == "nf4", shard_group_size(mesh)
    if model_cfg.load == "full":
        model = build_lora_model(model_cfg, lora_cfg, seed, device, reference and reference.lora)
        quantize = partial(quantize_layer, shards=shards, full_weight=lambda linear: linear.weight)
        model = shard_model(model, mesh, fsdp_cfg, model_cfg.compile, quantize if nf4 else None)
    else:
        model = build_meta_lora_model(model_cfg, lora_cfg, seed, reference=reference and reference.lora)
        index, _ = checkpoint_index(model.get_base_model(), weight_files(model_cfg))
        with torch.no_grad(), SliceReader(index) as reader:
            quantize = partial(quantize_layer, shards=shards, full_weight=checkpoint_weight(model, reader, device))
            model = shard_model(model, mesh, fsdp_cfg, model_cfg.compile, quantize if nf4 else None)
            materialize_from_slices(model, reader, seed, device)
    if init_adapter is not None:
        load_adapter_weights(model, init_adapter)
    if reference is not None:
        load_adapter_weights(model, reference.weights, REFERENCE)
    if attends_per_record(model_cfg, device) and not model_cfg.compile:
        use_segments_on_cpu(model.get_base_model())  # packed rows: attention per record (compiled: a recompile each)
    return model

"""Memory-lean model building: no rank ever holds the whole base model.

The simple path (app.model.build_lora_model, then shard) loads every weight in every worker: N full
copies in host memory per node. Here the model is built on the meta device, LoRA is applied and the
model sharded while it has no storage, and only then does each rank allocate and fill its own
shards: base weights read as slices of the safetensors files (memory-mapped, so a rank reads only
its rows), LoRA weights initialised explicitly (meta LoRA weights would otherwise stay garbage).
Peak host memory of a worker while loading scales with 1/N of the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from app.model import apply_lora, build_lora_model, enable_activation_checkpointing, torch_dtype
from app.sharding import shard_model

PEFT_PREFIX = "base_model.model."


def build_sharded_lora_model(model_cfg, lora_cfg, fsdp_cfg, mesh, seed: int, device: torch.device) -> nn.Module:
    """The FSDP2-sharded PEFT LoRA model, loaded the way `model.load` says."""
    if model_cfg.load == "full":
        return shard_model(build_lora_model(model_cfg, lora_cfg, seed, device), mesh, fsdp_cfg)
    model = shard_model(build_meta_lora_model(model_cfg, lora_cfg, seed), mesh, fsdp_cfg)
    materialize_sharded(model, model_cfg, seed, device)
    return model


def build_meta_lora_model(model_cfg, lora_cfg, seed: int, config_file: str | None = None):
    """The PEFT LoRA model with every parameter on the meta device; buffers (rotary tables, which
    no checkpoint holds) are computed on the CPU as usual. Reads only the model's config (or
    `config_file`, a config.json of any model shape)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if config_file:
        fields = json.loads(Path(config_file).read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(model_cfg.path, revision=model_cfg.revision,
                                            trust_remote_code=model_cfg.trust_remote_code)
    with init_empty_weights(include_buffers=False):
        base = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(model_cfg.dtype),
                                                trust_remote_code=model_cfg.trust_remote_code)
    model = apply_lora(base, lora_cfg, seed)
    if model_cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model


def materialize_sharded(model: nn.Module, model_cfg, seed: int, device: torch.device) -> None:
    """After fully_shard: allocate each rank's shards on `device` and fill them."""
    allocate_local_shards(model, device)
    with torch.no_grad():
        load_base_shards(model, weight_files(model_cfg))
        init_lora_shards(model, seed)


@torch.no_grad()
def allocate_local_shards(model: nn.Module, device: torch.device) -> None:
    """Give every parameter (uninitialised) local storage on `device`, keeping the buffers' values."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, buffer in buffers.items():
        model.get_buffer(name).copy_(buffer)


def weight_files(model_cfg) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (a local directory, or the hub cache)."""
    root = Path(model_cfg.path)
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(model_cfg.path, revision=model_cfg.revision,
                                      allow_patterns=["*.safetensors", "*.json"]))
    index = root / "model.safetensors.index.json"
    if index.exists():
        return {key: root / file for key, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    files = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            files.update({key: file for key in f.keys()})
    return files


def checkpoint_key(param_name: str) -> str:
    """PEFT's name of a base weight -> its name in the model's own checkpoint."""
    return param_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `param` and which part of the full tensor it holds."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def load_base_shards(model: nn.Module, files: dict[str, Path]) -> None:
    """Copy each frozen weight's local rows out of the safetensors files (only those bytes are read)."""
    from safetensors import safe_open

    handles = {}
    try:
        for name, param in model.named_parameters():
            if param.requires_grad:
                continue
            key = checkpoint_key(name)
            if key not in files:
                raise KeyError(f"{name}: no weight '{key}' in the model's safetensors files")
            if files[key] not in handles:
                handles[files[key]] = safe_open(files[key], framework="pt")
            local, region = local_region(param)
            if local.numel():
                local.copy_(handles[files[key]].get_slice(key)[region].to(local.dtype))
    finally:
        handles.clear()


def init_lora_shards(model: nn.Module, seed: int) -> None:
    """PEFT's default LoRA init, computed whole and identically on every rank (seeded), then sliced:
    lora_A Kaiming-uniform, lora_B zero, so the adapter starts as a no-op for any worker count."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        full = torch.zeros(param.shape, dtype=torch.float32)
        if "lora_A" in name:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        elif "lora_B" not in name:
            raise ValueError(f"{name}: a trainable weight this loader does not know how to initialise")
        local, region = local_region(param)
        local.copy_(full[region].to(local.dtype))

"""The adapter's initial weights, the same for either loading path and any worker count.

PEFT's default initialisation, computed whole from the seed on every rank and then sliced to the rank's
shard: lora_A Kaiming-uniform, lora_B zero (the adapter starts as a no-op), and for DoRA the magnitude
vector equal to the row norms of the whole base weight (not of a shard of it). Because both
`model.load: full` and `model.load: sharded` call this, they start from the same adapter for a seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from app.model.sharding import local_region

# (base weight name, rows) -> those rows of the frozen weight, whole along every other dimension
BaseRows = Callable[[str, slice], torch.Tensor]
PEFT_PREFIX = "base_model.model."


def base_param_name(peft_name: str) -> str:
    """PEFT's name of a base weight -> its name in the model before PEFT wrapped it."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int, base_rows: BaseRows) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        local, region = local_region(param)
        if "lora_magnitude_vector" in name:  # DoRA: ||W + scale * B A|| per output row, with B = 0
            weight = name.split(".lora_magnitude_vector.")[0] + ".weight"
            local.copy_(base_rows(base_param_name(weight), region[0]).float().norm(p=2, dim=1).to(local.dtype))
            continue
        full = torch.zeros(param.shape, dtype=torch.float32)
        if "lora_A" in name:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        elif "lora_B" not in name:
            raise ValueError(f"{name}: a trainable weight the LoRA initialisation does not know")
        local.copy_(full[region].to(local.dtype))


def rows_of_loaded_model(model: nn.Module) -> BaseRows:
    """BaseRows for a model whose base weights are in memory, whole (before sharding)."""
    weights = {base_param_name(n): p for n, p in model.named_parameters() if not p.requires_grad}
    return lambda name, rows: weights[name][rows]

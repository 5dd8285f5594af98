"""The LoRA adapter: PEFT's wrapping of the base (frozen, adapter weights in fp32), its weights' names, and
its starting values: from the seed, the same for either way of loading and any worker count, or from a
saved adapter's weights.

From the seed: PEFT's default initialisation, computed whole on every rank and then sliced to the rank's
FSDP2 shard: lora_A Kaiming-uniform, lora_B zero (the adapter starts as a no-op), and for DoRA the magnitude
vector equal to the row norms of the whole base weight (not of a shard of it). From a saved adapter
(`model.init_adapter`): each rank copies its slice of every saved weight. Keys are mapped between a saved
file and the model's parameters by PEFT's own `get_peft_model_state_dict`, the function that wrote them.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from app.model.sharding import local_region

if TYPE_CHECKING:  # importable without pydantic: benchmarks/step.py runs on a bare GPU box
    from app.config.sections import LoraSection

REFERENCE = "reference"  # a frozen second adapter: DPO's starting adapter, or distillation's teacher


@dataclass(frozen=True)
class FrozenAdapter:
    """The frozen second adapter a model carries beside the trained one: its LoRA settings and its saved weights."""

    lora: LoraSection
    weights: dict[str, torch.Tensor]


ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# (base weight name, rows) -> those rows of the frozen weight, whole along every other dimension
BaseRows = Callable[[str, slice], torch.Tensor]


def apply_lora(base, lora: LoraSection | dict[str, LoraSection], seed: int, reference: LoraSection | None = None):
    """Wrap `base` in a PEFT LoRA model: base frozen, adapter weights in fp32. Its weights get their starting
    values afterwards (`init_lora_weights` or `load_adapter_weights`). `lora`: one adapter ("default"), or several
    by name (`adapters:`), all trainable, the first active (app/model/row_routing.py routes the forward). With
    `reference` (its LoRA settings), a second adapter, frozen and without dropout: DPO's reference when a run starts
    from a trained adapter, or the teacher of on-policy distillation."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    (first, first_lora), *others = (lora if isinstance(lora, dict) else {"default": lora}).items()
    config = peft_config(first_lora)
    with peft_on_transformers_5():
        model = get_peft_model(base, config, adapter_name=first, autocast_adapter_dtype=True)  # LoRA in fp32
        for name, section in others:
            model.add_adapter(name, peft_config(section))
        for name, param in model.named_parameters():  # PEFT freezes the adapters added beside the active one
            if others and ".lora_" in name:
                param.requires_grad_(True)
        if reference is not None:  # PEFT leaves an added adapter frozen while "default" is the active one
            frozen = peft_config(reference)
            frozen.lora_dropout, frozen.inference_mode = 0.0, True
            model.add_adapter(REFERENCE, frozen)
    return model


def peft_config(lora: LoraSection):
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_dora=lora.use_dora,
                      use_rslora=lora.use_rslora, target_modules=lora.target_modules, task_type="CAUSAL_LM",
                      bias="none")


def adapter_of(param_name: str) -> str:
    """The adapter a LoRA weight belongs to (`<module>.lora_A.<adapter>.weight` -> adapter)."""
    return param_name.split(".lora_", 1)[1].split(".")[1]


@contextlib.contextmanager
def peft_on_transformers_5():
    """Around PEFT's model wrapping and adapter loading: PEFT 0.21 reads transformers 5's deprecated
    `is_gradient_checkpointing`, a FutureWarning in every job's and server's log that no setting of ours
    causes (PEFT's to change)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def is_adapter_param(name: str, adapter_name: str) -> bool:
    """A LoRA weight of `adapter_name` (PEFT names them `<module>.lora_A.<adapter>.weight`, ...), not a base weight."""
    return ".lora_" in name and f".{adapter_name}." in name


def base_param_name(peft_name: str) -> str:
    """PEFT's name of a base weight -> its name in the model before PEFT wrapped it."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int, base_rows: BaseRows) -> None:
    """Every trainable LoRA weight's starting value from `seed`, whole on every rank, then this rank's slice. Each
    adapter draws from its own generator of that seed: an adapter starts where it would start trained alone."""
    generators: dict[str, torch.Generator] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        generator = generators.setdefault(adapter_of(name) if ".lora_" in name else "",
                                          torch.Generator().manual_seed(seed))
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


def saved_keys(model: nn.Module, adapter_name: str) -> dict[str, str]:
    """The key each of `adapter_name`'s parameters has in a saved adapter -> the parameter's name."""
    from peft.utils import get_peft_model_state_dict

    names = [n for n, _ in model.named_parameters() if is_adapter_param(n, adapter_name)]
    tagged = {name: torch.tensor(i) for i, name in enumerate(names)}
    saved = get_peft_model_state_dict(model, state_dict=tagged, adapter_name=adapter_name, save_embedding_layers=False)
    if len(saved) != len(names):  # a weight left unmapped would keep uninitialised memory
        raise RuntimeError(f"PEFT maps {len(saved)} of adapter {adapter_name}'s {len(names)} weights to saved keys")
    return {key: names[int(index)] for key, index in saved.items()}


def read_adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / ADAPTER_WEIGHTS))


@torch.no_grad()
def load_adapter_weights(model: nn.Module, weights: dict[str, torch.Tensor], adapter_name: str = "default") -> None:
    """Copy this rank's slice of each saved weight into `adapter_name`'s parameters (sharded or whole)."""
    for key, name in saved_keys(model, adapter_name).items():
        local, region = local_region(model.get_parameter(name))
        if local.numel():
            local.copy_(weights[key][region].to(local.dtype))

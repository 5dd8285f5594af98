"""Exporting the trained adapter from a sharded model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def gather_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FULL tensor of every trainable (LoRA) parameter, on the CPU, on every rank.

    A collective: every rank must call it. Gathering only what trains avoids all-gathering the frozen
    base, and gathering every shard (not rank 0's slice) is what makes the saved lora_B whole.
    """
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            state[name] = full.detach().to("cpu", copy=True)
    return state


def save_adapter(peft_model, trainable_state: dict[str, torch.Tensor], out_dir: Path, tokenizer) -> Path:
    """A PEFT adapter directory that `PeftModel.from_pretrained(base, out_dir)` loads as it is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out_dir, state_dict=trainable_state, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir

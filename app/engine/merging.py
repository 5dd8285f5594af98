"""One LoRA adapter merged into the base weights the engine decodes with, for a process that samples from a single
policy whose adapter changes at every sync (a rollout actor): its steps then run the base's products alone, with
no LoRA product beside each (a 2-core Xeon, SmolLM2-135M, r=16 on every linear layer, a GRPO step's 64 answers:
1.3x the answers per second of LoRA beside the base on one core and on two, the merge at each sync counted;
benchmarks/rollouts.py).

Each merge starts from a copy of the untouched base weights (kept on the host), never from the previous merge, so
the weights sampled with are W + BA of this very adapter however many syncs came before: merging and unmerging
in place would add a rounding error in the weights' dtype at every sync. Only plain LoRA linear layers merge
(`unmergeable` says why a model's do not: DoRA, LoRA on embeddings, a quantized base, modules saved whole).
"""

from __future__ import annotations

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from app.engine.kernels import repack


def lora_layers(model: nn.Module) -> list[tuple[str, BaseTunerLayer]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def unmergeable(model: nn.Module, adapter: str) -> str | None:
    """Why `adapter` cannot be merged into `model`'s base weights, or None where it can."""
    layers = lora_layers(model)
    if not layers:
        return "the model has no LoRA layers"
    for name, layer in layers:
        if type(layer) is not LoraLinear:
            return f"{name} is a {type(layer).__name__}, not a plain LoRA linear layer"
        if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
            return f"{name} carries DoRA or a LoRA bias, applied at every step"
        base = layer.get_base_layer()
        if type(base) is not nn.Linear or not base.weight.dtype.is_floating_point or base.weight.element_size() < 2:
            return f"{name}'s base weight is {type(base).__name__} {base.weight.dtype} (quantized): nothing to add to"
    if any("modules_to_save" in name for name, _ in model.named_modules()):
        return "the adapter saves whole modules beside its LoRA layers"
    return None


class MergedAdapter:
    """`adapter`'s LoRA layers merged into `model`'s base weights by `merge`, from the base as it was built."""

    def __init__(self, model: nn.Module, adapter: str):
        why = unmergeable(model, adapter)
        if why is not None:
            raise ValueError(f"the adapter cannot be merged: {why}")
        self.adapter = adapter
        self.layers = [layer for _, layer in lora_layers(model)]
        self.untouched = [layer.get_base_layer().weight.detach().to("cpu", copy=True) for layer in self.layers]

    @torch.no_grad()
    def merge(self) -> None:
        """Every base weight set to its untouched value plus the adapter's current LoRA product (in fp32)."""
        for layer, untouched in zip(self.layers, self.untouched):
            weight = layer.get_base_layer().weight
            delta = layer.get_delta_weight(self.adapter).float()
            weight.copy_((untouched.to(weight.device, torch.float32) + delta).to(weight.dtype))
            repack(layer.get_base_layer())

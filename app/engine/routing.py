"""Which forward a step's tokens run through: each token's sequence names its adapter (None: the base alone).

A step takes the cheapest path that answers it exactly:
- every token on the base: a view of the base model without PEFT's wrappers, sharing every weight (PEFT's
  wrappers cost a lone request's step time even with no adapter active);
- every token on one adapter: PEFT's own forward with that adapter active;
- tokens on several adapters: PEFT's forward with none active (the base layers alone), and a hook on each LoRA
  layer that adds each adapter's LoRA output to its own tokens (gathered by index, PEFT's casts and scaling), so
  sequences of many adapters share one forward through the base. Only plain LoRA Linear layers can be routed that
  way (`mixable`); with DoRA or LoRA on embeddings a step runs one adapter's tokens.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

NONE_ACTIVE = "__none__"  # no adapter of that name exists: PEFT's layers run their base layer alone


def base_view(module: nn.Module) -> nn.Module | None:
    """`module` (a PEFT-wrapped model) as it was before the adapters were injected: a shallow copy of each
    module whose children are the wrapped layers' own base layers. Every parameter and buffer is shared, so
    the view costs no weight memory and sees any change to the base. None where a module's forward is bound
    to the module itself (accelerate's offload hooks, `Module.compile`): a copy would run the original."""
    if isinstance(module, BaseTunerLayer):
        return base_view(module.get_base_layer())
    if isinstance(module, AuxiliaryTrainingWrapper):  # modules_to_save: the base's own copy
        return base_view(module.original_module)
    if hasattr(module, "_hf_hook") or getattr(module, "_compiled_call_impl", None) is not None:
        return None
    view = copy.copy(module)
    view._parameters, view._buffers = dict(module._parameters), dict(module._buffers)
    view._modules = {}
    for name, child in module._modules.items():
        view._modules[name] = None if child is None else base_view(child)
        if child is not None and view._modules[name] is None:
            return None
    return view


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class Router:
    """The module a step calls, and the routing its adapters need. Used by the engine's thread only (activating an
    adapter changes the model)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.peft = is_peft(model)
        self.base = base_view(model.get_base_model()) if self.peft else model
        self.hooks: list = []
        self.forget()

    def forget(self) -> None:
        """Before and after the adapters change (one loaded or deleted): PEFT's own record of the active adapter
        put back on every layer (PEFT's `delete_adapter` reads it from them), the LoRA layers found again."""
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.groups = [], []
        if self.peft and getattr(self, "active", None) is not None:
            self.activate(self.recorded())
        self.layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)] if self.peft else []
        self.active: str | None = None

    def recorded(self) -> str:
        """The adapter PEFT has as active (an existing one, where its record names one deleted since)."""
        named = self.model.active_adapter
        if not isinstance(named, str) or named not in self.model.peft_config:
            named = next(iter(self.model.peft_config))
            self.model.base_model.active_adapter = named
        return named

    def knows(self, adapter: str | None) -> bool:
        return adapter is None or (self.peft and adapter in self.model.peft_config)

    @property
    def mixable(self) -> bool:
        """Whether tokens of several adapters can share a step."""
        return all(isinstance(layer, LoraLinear) and not layer.lora_variant for layer in self.layers)

    def activate(self, name: str) -> None:
        if self.active != name:  # a walk over the LoRA layers: once per change, not per step
            for layer in self.layers:
                layer._active_adapter = name
            self.active = name

    @contextlib.contextmanager
    def route(self, adapters: list[str | None]):
        """Within: the module to call for a step whose i-th token runs through adapters[i]."""
        names = set(adapters)
        if names == {None} and self.base is not None:
            yield self.base
            return
        if not self.peft:
            raise ValueError(f"adapter {next(n for n in names if n)!r} asked of a model without adapters")
        if len(names) == 1:  # one adapter; or the base where no view of it could be made: PEFT with none active
            self.activate(next(iter(names)) or NONE_ACTIVE)
            yield self.model
            return
        if not self.hooks:
            self.hooks = [layer.register_forward_hook(self._add_lora) for layer in self.layers]
        self.activate(NONE_ACTIVE)
        device = next(self.model.parameters()).device
        self.groups = [(name, torch.tensor([i for i, a in enumerate(adapters) if a == name], device=device))
                       for name in names if name is not None]
        try:
            yield self.model
        finally:
            self.groups = []

    def _add_lora(self, layer: LoraLinear, args: tuple, output: torch.Tensor) -> None:
        """Each adapter's LoRA output added to its own tokens of the base layer's `output` (in place)."""
        if not self.groups:
            return None
        x = args[0].reshape(-1, args[0].shape[-1])
        flat = output.view(-1, output.shape[-1])
        for name, index in self.groups:
            if name in layer.lora_A:
                lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
                inputs = layer._cast_input_dtype(x.index_select(0, index), lora_a.weight.dtype)
                flat.index_add_(0, index, (lora_b(lora_a(inputs)) * layer.scaling[name]).to(flat.dtype))
        return None

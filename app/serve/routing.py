"""Which forward a batch of the server's rows runs: each row names its adapter (None: the base alone).

PEFT can give every row of a batch its own adapter (`adapter_names`), but it pays for that on every token:
each LoRA layer splits the batch by adapter and joins it again. On a small model that doubles a lone
request's time per token, and even its base-alone rows run through the wrappers. So a batch takes the
cheapest path that answers it exactly:
- every row on the base: a view of the base model without PEFT's wrappers, sharing every weight;
- every row on one adapter: PEFT's active adapter (the plain LoRA forward);
- rows on different adapters: `adapter_names`.
"""

from __future__ import annotations

import copy

from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

NO_ADAPTER = "__base__"  # PEFT's row name for the base model alone


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


class Router:
    """The model to run a batch on, and the arguments that pick its rows' adapters. Used by the generation
    thread only (setting PEFT's active adapter changes the model)."""

    def __init__(self, model):
        self.model = model
        self.base = base_view(model.get_base_model())
        self.active: str | None = None  # the adapter this router made active, while nothing else changed it

    def forget(self) -> None:
        """The adapters changed (one loaded or deleted): PEFT's active adapter is no longer known. After a
        delete each LoRA layer picks its own next adapter, so PEFT's model-level one may not be every layer's."""
        self.active = None

    def route(self, adapters: list[str | None]) -> tuple[nn.Module, dict]:
        names = set(adapters)
        if names == {None} and self.base is not None:
            return self.base, {}
        if len(names) == 1 and None not in names:
            [name] = names
            if self.active != name:  # a walk over every module: once per change, not per batch
                self.model.set_adapter(name, inference_mode=True)
                self.active = name
            return self.model, {}
        return self.model, {"adapter_names": [name or NO_ADAPTER for name in adapters]}

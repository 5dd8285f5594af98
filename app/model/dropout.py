"""LoRA dropout whose draws are a function of where they happen, not of what ran before them.

PEFT's LoRA dropout draws from the global generator, so a mask depends on every draw before it: two adapters
trained side by side, in turn or with their rows in one micro-batch, would draw other masks than each trained
alone. `KeyedDropout` draws each mask from a generator seeded by the training position (seed, step, rank and
micro-batch: `DropoutKey`, set by the recipe) and the layer's name. So a layer's mask for a micro-batch is the
same in any run that computes it, whichever adapter runs and however many others share the pass; activation
checkpointing's recomputation, which happens under the same key, draws it again exactly. The mask is drawn
over the input's elements in memory order, so the rows of one adapter taken from a shared micro-batch (a
contiguous block) get the mask the same rows get alone. Outside a training position (the key unset) it is
plain dropout.
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.nn.functional as F
from torch import nn

POSITION_BITS = 63


class DropoutKey:
    """The training position every KeyedDropout of a model draws for; None outside the training loop."""

    def __init__(self) -> None:
        self.position: tuple[int, ...] | None = None

    @contextlib.contextmanager
    def at(self, *position: int):
        self.position = position
        try:
            yield
        finally:
            self.position = None


class KeyedDropout(nn.Module):
    def __init__(self, p: float, layer: str, key: DropoutKey):
        super().__init__()
        self.p, self.layer, self.key = p, zlib.crc32(layer.encode()), key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.key.position is None:
            return F.dropout(x, self.p, self.training)
        seed = hash((*self.key.position, self.layer)) & (2**POSITION_BITS - 1)  # ints hash the same in any process
        return x * kept(x, self.p, seed) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"


@torch.compiler.disable  # a generator of its own: a graph break under torch.compile (model.compile)
def kept(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Which of `x`'s elements dropout keeps (bool, x's shape), drawn in memory order from `seed`."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    return (torch.rand(x.numel(), generator=generator, device=x.device) >= p).view(x.shape)


def key_lora_dropout(model: nn.Module) -> DropoutKey:
    """Replace every LoRA dropout of `model` (PEFT's `nn.Dropout`, one per adapter and layer) by a KeyedDropout
    named after its layer, not its adapter; the key they share."""
    key = DropoutKey()
    for name, module in model.named_modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for adapter, dropout in dropouts.items():
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                dropouts[adapter] = KeyedDropout(dropout.p, name, key).train(dropout.training)
    return key

"""The matrix kernels the engine's CPU forward runs: oneDNN with each frozen linear weight reordered once into the
layout its kernels read (what inductor's `freezing` does for a compiled CPU model), where that is faster here.

On a CPU with bf16 matrix units (AMX, AVX-512 BF16) a decoding step's products are small (one row per sequence):
PyTorch's plain bf16 linear reorders the weight on every call, and the reordered one ran them 1.3-2.5x faster
(1 and 32 rows, SmolLM2's shapes, a 2-core Xeon); in fp32 it was slower for one row. So the choice is measured on
the machine at hand, on the model's own largest decoder shape, never assumed. Only frozen base weights are
reordered (each keeps its weight: PEFT and the base view still read it); the adapters' small LoRA products run as
they are, their weights changing with every sync. A base weight that changes (an adapter merged into it for
sampling: app/engine/merging.py) is reordered again by `repack`.
"""

from __future__ import annotations

import time

import torch
from torch import nn

ROWS = (1, 32)  # decoding step sizes the choice is timed at: a lone request, a full batch


def reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class Packed:
    """A layer's reordered weight, shared by every copy of the layer's forward (the router's base view copies the
    layer): replacing `weight` here reaches them all."""

    def __init__(self, weight: torch.Tensor):
        self.weight = reorder(weight)


def packed_forward(layer: nn.Linear, packed: Packed):
    bias = None if layer.bias is None else layer.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "")
    forward.packed = packed
    return forward


def repack(layer: nn.Linear) -> None:
    """The layer's reordered weight made again from its weight, which changed (nothing where it is not reordered)."""
    packed = getattr(layer.__dict__.get("forward"), "packed", None)
    if packed is not None:
        packed.weight = reorder(layer.weight)


def seconds(run, repeats: int = 15) -> float:
    """The fastest of `repeats` calls (the least disturbed by whatever else the machine runs)."""
    run()
    fastest = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        fastest = min(fastest, time.perf_counter() - started)
    return fastest


def reordering_pays(layer: nn.Linear) -> bool:
    """Whether the reordered weight multiplies faster than the plain one at every step size timed, here."""
    try:
        packed = reorder(layer.weight)
    except (RuntimeError, AttributeError):  # a build without oneDNN, a dtype it does not take
        return False
    weight = layer.weight.detach()
    for rows in ROWS:
        x = torch.randn(1, rows, weight.shape[1], dtype=weight.dtype)
        plain = seconds(lambda x=x: torch.nn.functional.linear(x, weight))
        reordered = seconds(lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        if reordered >= plain:
            return False
    return True


def base_linears(model: nn.Module) -> list[nn.Linear]:
    """The base model's CPU linear layers (not PEFT's LoRA products), the output head last."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = [m for name, m in model.named_modules() if type(m) is nn.Linear and ".lora_" not in name
              and m is not head and m.weight.device.type == "cpu" and m.weight.dtype in (torch.bfloat16, torch.float32)]
    return layers + ([head] if type(head) is nn.Linear and head.weight.device.type == "cpu" else [])


def reorder_linears(model: nn.Module) -> bool:
    """Every base linear layer of `model` (frozen: the engine only decodes) through its reordered weight, where
    the model's largest decoder layer multiplies faster so here; whether it was done."""
    layers = base_linears(model)
    decoder = layers[:-1] if model.get_output_embeddings() in layers else layers
    if not decoder or not reordering_pays(max(decoder, key=lambda m: m.weight.numel())):
        return False
    for layer in layers:
        layer.forward = packed_forward(layer, Packed(layer.weight))
    return True

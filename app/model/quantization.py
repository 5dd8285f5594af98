"""QLoRA's 4-bit base: the frozen linear weights of the decoder layers stored as NF4.

NF4 (the QLoRA paper's 4-bit NormalFloat) keeps 16 levels per block of 64 weights and one absmax scale per
block; the scales are quantized again to int8 in groups (double quantization). torchao's `NF4Tensor` holds
the format and implements FSDP2's all-gather hooks, so each rank stores its NF4 rows and the all-gather moves
the 4-bit bytes; a linear layer dequantizes its weight to the input's dtype when it runs (the LoRA weights
stay fp32 masters, compute is in `fsdp.param_dtype`). Embeddings, norms and the LM head are not quantized.

Both loading paths quantize the same full weight with the same block sizes, one decoder layer at a time
just before that layer is sharded, so `model.load: full` and `sharded` give the same NF4 bytes; with
`sharded` a rank never holds more than one unquantized matrix beyond its NF4 shards (with `full` it has
loaded the whole model first, as without quantization).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

NF4_BLOCK = 64  # weights per absmax scale (QLoRA's block)
NF4_SCALER_BLOCK = 256  # scales per double-quantization group (QLoRA's)
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK  # 4-bit codes and an int8 scale per block (group factors: ~0)


def is_nf4(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return type(local).__name__ == "NF4Tensor"


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for a (possibly sharded) parameter: an NF4 weight's codes and scales."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if is_nf4(local):
        return sum(t.numel() * t.element_size() for t in (local.quantized_data, local.quantized_scalers,
                                                           local.quantization_factor))
    return local.numel() * local.element_size()


def scaler_block_size(shape: torch.Size | tuple[int, ...], shards: int) -> int | None:
    """The double-quantization group for a weight of `shape` sharded `shards` ways: QLoRA's 256 scales, or
    the largest power of two below it that lets every shard hold whole blocks and whole groups (small
    models only); None where no group size does (the rows do not split evenly, or the weight is not whole
    blocks)."""
    rows, numel = shape[0], torch.Size(shape).numel()
    if rows % shards or numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    size = NF4_SCALER_BLOCK
    while size and blocks % (size * shards):
        size //= 2
    return size or None


def quantize_nf4(weight: torch.Tensor, shards: int) -> torch.Tensor:
    size = scaler_block_size(weight.shape, shards)
    if size is None:
        raise ValueError(f"a {tuple(weight.shape)} weight cannot be stored as NF4 split {shards} ways")
    from torchao.quantization import to_nf4  # its import-time log lines: app/logs.py

    return to_nf4(weight.contiguous(), NF4_BLOCK, size)


def quantizable_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The base model's linear layers inside a decoder layer (PEFT's `base_layer`s where LoRA wraps them; not
    the LoRA matrices nor a trained copy), by their names within the layer."""
    return {name: module for name, module in layer.named_modules()
            if isinstance(module, nn.Linear) and ".lora_" not in f".{name}" and "modules_to_save" not in name
            and module.weight.dim() == 2}


def quantization_problem(model: nn.Module, layers: list[nn.Module], shards: int) -> str | None:
    """Why this model's decoder layers cannot be stored as NF4 over `shards` ranks (None if they can); the
    model may be on the meta device."""
    names = {module: name for name, module in model.named_modules()}
    for layer in layers:
        for name, linear in quantizable_linears(layer).items():
            if scaler_block_size(linear.weight.shape, shards) is None:
                return (f"{names[layer]}.{name} is {tuple(linear.weight.shape)}: its rows do not split into "
                        f"{shards} shards of whole {NF4_BLOCK}-weight blocks")
    return None


@torch.no_grad()
def quantize_layer(layer: nn.Module, shards: int, full_weight: Callable[[nn.Linear], torch.Tensor]) -> None:
    """Replace each base linear weight of `layer` by its NF4 form (frozen); `full_weight(linear)` gives the
    unquantized weight (the module's own, or read from the checkpoint when the model is on meta)."""
    for name, linear in quantizable_linears(layer).items():
        if linear.weight.requires_grad:
            raise ValueError(f"{name}: a trained weight cannot be stored as NF4 (only the frozen base is)")
        linear.weight = nn.Parameter(quantize_nf4(full_weight(linear), shards), requires_grad=False)

"""Which adapter a training forward runs through: one adapter for the whole batch, or one per block of rows.

Several adapters trained side by side (`adapters:`) stay trainable together; PEFT's `set_adapter` would freeze
all but one, and PEFT's per-row `adapter_names` is refused in training mode. So the routing is the product's:
- one adapter: every LoRA layer's active adapter set to it, and PEFT's own forward runs (`activate`);
- several (`rows_through`): the micro-batch holds one contiguous block of rows per adapter; PEFT's
  forward runs the base layer alone (no adapter active), and a forward hook adds each block's LoRA output from
  that block's adapter, with PEFT's own casts, dropout and scaling. A block's rows see exactly the computation
  PEFT's single-adapter forward gives them (tests/unit/model/test_row_routing.py), and their gradients reach
  their adapter's weights alone.
"""

from __future__ import annotations

import contextlib

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

NONE_ACTIVE = "__rows__"  # no adapter of that name exists: PEFT's forward runs the base layer alone


class AdapterRouting:
    """The LoRA layers of a PEFT model, found once, and the adapter(s) its training forward runs through."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self.blocks: tuple[str, ...] = ()  # while routing rows: the adapter of each block, in order
        self.block_rows: tuple[int, ...] = ()  # and its rows
        self.hooks: list = []

    def activate(self, name: str) -> None:
        """Every LoRA layer's forward through adapter `name` alone; every adapter stays trainable."""
        self._route_layers(name)
        self.model.base_model.active_adapter = name

    def _route_layers(self, name: str) -> None:
        for layer in self.layers:
            layer._active_adapter = name

    @contextlib.contextmanager
    def rows_through(self, names: list[str], rows: list[int] | None = None):
        """Within: the forward's rows in len(names) blocks (of `rows[i]` rows each; None: equal), block i through
        adapter names[i]."""
        if len(names) == 1:
            self.activate(names[0])
            yield
            return
        if not self.hooks:
            if other := [layer for layer in self.layers if not isinstance(layer, LoraLinear) or layer.lora_variant]:
                raise NotImplementedError(f"adapters sharing a micro-batch route plain LoRA Linear layers only, not "
                                          f"{type(other[0]).__name__} {other[0].lora_variant or ''}; set "
                                          "train.adapters_per_micro_batch=1")
            self.hooks = [layer.register_forward_hook(self._add_blocks) for layer in self.layers]
        self.model.base_model.active_adapter = names[0]  # what PEFT's model-level code reads; the layers run none
        self._route_layers(NONE_ACTIVE)
        self.blocks, self.block_rows = tuple(names), tuple(rows or [1] * len(names))
        try:
            yield
        finally:
            self.blocks = ()

    def size_blocks(self, rows: list[int]) -> None:
        """Within `rows_through`: the rows of each block in the forwards that follow (until sized again)."""
        self.block_rows = tuple(rows)

    def _add_blocks(self, layer: LoraLinear, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """The base layer's `output` plus each block's LoRA output (what PEFT's Linear.forward adds)."""
        if not self.blocks:
            return None
        x = args[0].reshape(-1, args[0].shape[-1])  # packed rows laid end to end (flash) block the same way
        per_row, left = divmod(x.shape[0], sum(self.block_rows))
        if left:
            raise ValueError(f"{x.shape[0]} positions do not split into blocks of {self.block_rows} rows")
        sizes = [rows * per_row for rows in self.block_rows]
        blocks = x.split(sizes)  # one split: its backward is one cat
        added: list[torch.Tensor | None] = [None] * len(self.blocks)
        for group in same_shape_groups(layer, self.blocks, sizes):  # one batched product per shape
            names = [self.blocks[i] for i in group]
            dtype = layer.lora_A[names[0]].weight.dtype
            inputs = torch.stack([layer.lora_dropout[name](layer._cast_input_dtype(blocks[i], dtype))
                                  for i, name in zip(group, names, strict=True)])
            down = torch.stack([layer.lora_A[name].weight for name in names]).transpose(1, 2)
            up = torch.stack([layer.lora_B[name].weight for name in names]).transpose(1, 2)
            scaled = torch.bmm(torch.bmm(inputs, down), up) * layer.scaling[names[0]]  # a float, as PEFT's
            for i, lora in zip(group, scaled, strict=True):
                added[i] = lora
        lora = torch.cat([output.new_zeros(size, output.shape[-1]) if block is None else block  # not targeted
                          for block, size in zip(added, sizes, strict=True)])
        return (output + lora.view(*output.shape[:-1], -1)).to(output.dtype)


def same_shape_groups(layer: LoraLinear, blocks: tuple[str, ...], sizes: list[int]) -> list[list[int]]:
    """The blocks whose adapters target `layer`, grouped by LoRA rank (their weights stack), scaling and block
    size (their inputs stack)."""
    groups: dict[tuple[int, float, int], list[int]] = {}
    for i, (name, size) in enumerate(zip(blocks, sizes, strict=True)):
        if name in layer.lora_A:
            groups.setdefault((layer.r[name], layer.scaling[name], size), []).append(i)
    return list(groups.values())

"""The policy merged into vLLM's own weights at each sync (rollout.engine vllm, rollout.policy merged): vLLM then
decodes the base's products alone, with no LoRA kernel beside them. On a CPU vLLM's LoRA kernels are its slow path
(12-14x slower than this project's engine, docs/methods.md); merged, it decodes at the base's speed.

vLLM's usual way in for new weights (its model's `load_weights`, what TRL's colocated vLLM calls) fails on a CPU:
vLLM packs each CPU linear layer's weight for its GEMM kernel (oneDNN, zentorch or AMX) once loaded and drops the
parameter its weight loader needs. So each sync sets every adapted linear layer's weight itself, in vLLM's layout
(q, k and v stacked in one qkv_proj, as the model's `packed_modules_mapping` says), and has vLLM's own post-load
step (`process_weights_after_loading`) pack it again; the prefix cache, computed with the old weights, is dropped.

As app/engine/merging.py does for this project's engine, each merge starts from a host copy of the untouched
base weights (read from the checkpoint), never from the previous merge: W + scale * B @ A in fp32, cast once.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from app.config.sections import ModelSection
from app.engine.merging import lora_layers, unmergeable
from app.model.base import build_meta_base_model
from app.model.slices import SliceReader, checkpoint_index, weight_files

PEFT_PREFIX = "base_model.model."
SYNC_BATCH_BYTES = 256 << 20  # merged weights handed to vLLM at once: a sync holds this much beyond the model


def packed_modules(model: nn.Module) -> dict[str, list[str]]:
    """In vLLM's process: the layers its model stacks (qkv_proj: [q_proj, k_proj, v_proj], ...)."""
    return dict(getattr(model, "packed_modules_mapping", {}))


def linear_shapes(model: nn.Module, names: list[str]) -> dict[str, tuple[int, int] | None]:
    """In vLLM's process: each named layer's (output, input) size, None where the model has no such linear layer."""
    modules, shapes = dict(model.named_modules()), {}
    for name in names:
        layer = modules.get(name)
        sizes = (getattr(layer, "output_size_per_partition", None), getattr(layer, "input_size_per_partition", None))
        shapes[name] = sizes if None not in sizes else None
    return shapes


def set_linear_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """In vLLM's process: each named linear layer's weight replaced. On a CPU, vLLM packed the loaded weight for
    its GEMM kernel and dropped it: the layer takes the new weight and vLLM's own post-load step packs it again."""
    for name, weight in weights.items():
        layer = model.get_submodule(name)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.quant_method.process_weights_after_loading(layer)


def vllm_layer_parts(modules: list[str], packed: dict[str, list[str]]) -> dict[str, list[str]]:
    """vLLM's layer for each adapted module (by its transformers path), with the modules it stacks in order."""
    stacked_in = {part: fused for fused, parts in packed.items() for part in parts}
    layers: dict[str, list[str]] = {}
    for module in modules:
        prefix, _, leaf = module.rpartition(".")
        fused = stacked_in.get(leaf)
        layers[f"{prefix}.{fused}" if fused else module] = \
            [f"{prefix}.{part}" for part in packed[fused]] if fused else [module]
    return layers


class VllmMergedPolicy:
    """The adapter of a PEFT model shaped like the trained one (`lora_model`, on the meta device), merged into the
    weights of vLLM engine `llm` by `merge`, from the base as the checkpoint holds it."""

    def __init__(self, llm, model_cfg: ModelSection, lora_model: nn.Module, dtype: torch.dtype):
        if why := unmergeable(lora_model, "default"):
            raise ValueError(f"rollout.policy=merged: the adapter cannot be merged into vLLM's weights: {why}")
        self.llm, self.dtype = llm, dtype
        self.scale = {name.removeprefix(PEFT_PREFIX): layer.scaling["default"]
                      for name, layer in lora_layers(lora_model)}  # adapted module -> its LoRA scale
        self.parts = vllm_layer_parts(list(self.scale), llm.apply_model(packed_modules)[0])
        self.rows: dict[str, int] = {}  # each stacked module's rows in its vLLM layer
        self.untouched = self.read_untouched(model_cfg)
        shapes = llm.apply_model(partial(linear_shapes, names=list(self.parts)))[0]
        for layer, weight in self.untouched.items():
            if shapes[layer] != tuple(weight.shape):
                raise ValueError(f"rollout.policy=merged: vLLM's model has no linear layer {layer} of shape "
                                 f"{tuple(weight.shape)} (it names or shapes its layers otherwise: found "
                                 f"{shapes[layer]}); set rollout.policy: lora")

    def read_untouched(self, model_cfg: ModelSection) -> dict[str, torch.Tensor]:
        """Each of vLLM's adapted layers' untouched weight (its stacked modules' in order), in vLLM's dtype."""
        index, converted = checkpoint_index(build_meta_base_model(model_cfg), weight_files(model_cfg))
        untouched = {}
        with SliceReader(index) as reader:
            for layer, parts in self.parts.items():
                names = [f"{part}.weight" for part in parts]
                if missing := [name for name in names if name in converted or name not in index]:
                    raise ValueError(f"rollout.policy=merged: no checkpoint tensor holds {missing[0]} as it is "
                                     "(fused or converted weights); set rollout.policy: lora")
                weights = [reader.rows(name, slice(None)).to(self.dtype) for name in names]
                self.rows |= {part: len(weight) for part, weight in zip(parts, weights)}
                untouched[layer] = torch.cat(weights)
        return untouched

    @torch.no_grad()
    def merge(self, adapter: dict[str, torch.Tensor]) -> None:
        """vLLM's adapted weights set to the untouched base plus `adapter`'s LoRA products (by parameter name)."""
        for batch in self.batches(adapter):
            self.llm.apply_model(partial(set_linear_weights, weights=batch))
        if not self.llm.reset_prefix_cache():  # its entries were computed with the previous weights
            raise RuntimeError("vLLM kept its prefix cache (requests were running during the sync): answers would "
                               "mix two policies")

    def batches(self, adapter: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        batch, size = {}, 0
        for layer, parts in self.parts.items():
            batch[layer] = self.merged(layer, parts, adapter)
            size += batch[layer].nbytes
            if size >= SYNC_BATCH_BYTES:
                yield batch
                batch, size = {}, 0
        if batch:
            yield batch

    def merged(self, layer: str, parts: list[str], adapter: dict[str, torch.Tensor]) -> torch.Tensor:
        weight, row = self.untouched[layer].to(torch.float32, copy=True), 0
        for part in parts:
            if part in self.scale:  # adapted (a stacked layer may hold modules the adapter leaves alone)
                a, b = (adapter[f"{PEFT_PREFIX}{part}.lora_{x}.default.weight"].float() for x in "AB")
                weight[row:row + self.rows[part]] += self.scale[part] * (b @ a)
            row += self.rows[part]
        return weight.to(self.dtype)

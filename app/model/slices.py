"""`model.load: sharded`: no rank ever holds the whole base model.

The model is built on the meta device, LoRA is applied and the model is split into its FSDP2 shards while it
has no storage (app/model/build.py); only then does each rank allocate and fill its own shards: base weights
read as slices of the safetensors files (memory-mapped, so a rank reads only its rows), LoRA weights
initialised explicitly (meta LoRA weights would otherwise stay garbage). A worker's peak host memory while
loading scales with 1/N of the model, where `model.load: full` loads N whole copies per node.

Checkpoint keys are mapped to the model's parameters with transformers' own renaming rules (e.g.
GPT-NeoX's `embed_out` is the model's `lm_head`); tied weights stay one parameter. What this loader
cannot map (parameters that transformers builds from several checkpoint tensors, such as fused MoE
experts) is found in the driver by `slice_loading_problem`, and the job then loads the model whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from app.errors import UserInputError
from app.model.adapter import REFERENCE, base_param_name, init_lora_weights, is_adapter_param
from app.model.base import build_meta_base_model
from app.model.quantization import is_nf4
from app.model.sharding import local_region

CheckpointIndex = dict[str, tuple[Path, str]]  # base parameter name -> (safetensors file, key in it)


def materialize_from_slices(model: nn.Module, reader: SliceReader, seed: int, device: torch.device) -> None:
    """After fully_shard: allocate each rank's shards on `device` and fill them."""
    allocate_local_shards(model, device)
    load_base_shards(model, reader)
    init_lora_weights(model, seed, reader.rows)


def checkpoint_weight(model: nn.Module, reader: SliceReader, device: torch.device):
    """`full_weight(linear)` for app.model.quantization.quantize_layer: a meta linear layer's whole weight,
    read from the checkpoint in the model's dtype."""
    names = {module: name for name, module in model.named_modules()}

    def full_weight(linear: nn.Linear) -> torch.Tensor:
        whole = tuple(slice(0, n) for n in linear.weight.shape)
        return reader.slice(base_param_name(f"{names[linear]}.weight"), whole).to(device, linear.weight.dtype)
    return full_weight


@torch.no_grad()
def allocate_local_shards(model: nn.Module, device: torch.device) -> None:
    """Give every parameter still on the meta device (uninitialised) local storage on `device`, keeping the
    buffers' values (and parameters that have storage already: NF4 weights quantized as their layer was
    sharded)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    # fully_shard placed the rest already (offloaded shards on the host); NF4's .to() would dequantize them
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for name, buffer in buffers.items():
        model.get_buffer(name).copy_(buffer)


def weight_files(model_cfg) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (a local directory, or the hub cache)."""
    root = Path(model_cfg.path)
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(model_cfg.path, revision=model_cfg.revision,
                                      allow_patterns=["*.safetensors", "*.json"]))
    index = root / "model.safetensors.index.json"
    if index.exists():
        return {key: root / file for key, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    files = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            files.update({key: file for key in f.keys()})
    return files


def checkpoint_index(base_model: nn.Module, files: dict[str, Path]) -> tuple[CheckpointIndex, set[str]]:
    """Each base parameter's (file, checkpoint key), renaming keys as transformers does when it loads;
    and the parameters transformers would build by merging or splitting checkpoint tensors (fused MoE
    experts, ...), which have no slice to read."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(base_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = {name: True for name, _ in base_model.named_parameters()}
    index: CheckpointIndex = {}
    converted: set[str] = set()
    for key, file in files.items():
        name, converted_by = rename_source_key(key, renamings, converters, base_model.base_model_prefix, names)
        if converted_by is None:
            index.setdefault(name, (file, key))
        else:
            converted.add(name)
    return index, converted


class SliceReader:
    """Reads row ranges of checkpoint tensors from memory-mapped safetensors files (only those bytes)."""

    def __init__(self, index: CheckpointIndex):
        self.index, self.handles = index, {}

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.handles.clear()

    def slice(self, name: str, region: tuple[slice, ...]) -> torch.Tensor:
        if name not in self.index:
            raise KeyError(f"{name}: no weight in the model's safetensors files maps to it")
        file, key = self.index[name]
        if file not in self.handles:
            from safetensors import safe_open

            self.handles[file] = safe_open(file, framework="pt")
        return self.handles[file].get_slice(key)[region]

    def rows(self, name: str, rows: slice) -> torch.Tensor:
        return self.slice(name, (rows,))


def load_base_shards(model: nn.Module, reader: SliceReader) -> None:
    """Copy each frozen base weight's local rows out of the checkpoint."""
    for name, param in model.named_parameters():
        if param.requires_grad or is_adapter_param(name, REFERENCE) or is_nf4(param):  # loaded already or no base
            continue
        local, region = local_region(param)
        if local.numel():
            local.copy_(reader.slice(base_param_name(name), region).to(local.dtype))


def checkpoint_keys(model_cfg) -> dict[str, Path | str]:
    """Checkpoint key -> file, from the safetensors headers only (a hub model's are fetched, not its weights)."""
    if Path(model_cfg.path).is_dir():
        return weight_files(model_cfg)
    from huggingface_hub import get_safetensors_metadata

    return dict(get_safetensors_metadata(model_cfg.path, revision=model_cfg.revision).weight_map)


def slice_loading_problem(model_cfg) -> str | None:
    """Why `model.load: sharded` cannot read this checkpoint slice by slice (None if it can): some of its
    parameters are built by transformers from several checkpoint tensors. Runs in the driver, on the
    config and the safetensors headers. A parameter that no checkpoint tensor gives at all is an error."""
    base = build_meta_base_model(model_cfg)
    index, converted = checkpoint_index(base, checkpoint_keys(model_cfg))
    missing = [name for name, _ in base.named_parameters() if name not in index]
    absent = [name for name in missing if name not in converted]
    if absent:
        raise UserInputError(f"model.path={model_cfg.path}: no weight in its safetensors files for "
                             f"{_some(absent)}; the checkpoint does not match its config.json")
    if missing:
        return f"transformers builds {_some(missing)} by converting checkpoint tensors"
    return None


def _some(names: list[str]) -> str:
    return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")

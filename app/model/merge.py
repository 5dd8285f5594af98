"""The base model with a LoRA adapter merged in, written as a Hugging Face safetensors directory.

Streams: base tensors are read one at a time from the memory-mapped checkpoint, the adapter's update is
added to each targeted weight (W + scale * B @ A, in fp32; DoRA rescales each output row to its learned
magnitude, as PEFT's own merge does), and the result is cast and appended to the current output shard,
which is written once it reaches `max_shard_bytes`. Host memory stays near one output shard plus the
adapter, whatever the model's size. Keys keep the base checkpoint's names, so transformers loads the
merged directory exactly as it loads the base.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from app.errors import UserInputError, first_line

PEFT_PREFIX = "base_model.model."
UNSUPPORTED = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "trainable_token_indices")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


def base_model_problem(base_path: Path) -> str | None:
    """Why `base_path` is not a Hugging Face model directory this merge reads, or None."""
    from transformers import CONFIG_MAPPING

    if not base_path.is_dir():
        return "no such directory"
    if not (base_path / "config.json").is_file():
        return "no config.json there"
    if not any(base_path.glob("*.safetensors")):
        return "no *.safetensors weights there"
    try:
        config = json.loads((base_path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        return f"its config.json cannot be read as JSON ({first_line(e)})"
    if not isinstance(config, dict) or config.get("model_type") not in CONFIG_MAPPING:
        return "its config.json names no model_type that transformers knows"
    return None


def merge_problem(adapter_dir: Path) -> str | None:
    """Why this merge cannot take the adapter in `adapter_dir`, or None."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        return f"{adapter_dir}: a {config.get('peft_type')} adapter; only LoRA merges"
    for key in UNSUPPORTED:
        if config.get(key):
            return (f"{adapter_dir}/adapter_config.json: {key} is set; this merge handles one rank and alpha for "
                    "every targeted linear layer (the job's adapters)")
    if config.get("fan_in_fan_out") or config.get("lora_bias"):
        return f"{adapter_dir}/adapter_config.json: fan_in_fan_out / lora_bias adapters do not merge here"
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as f:  # the header only
        if any("lora_embedding_" in key for key in f.keys()):
            return f"{adapter_dir}: LoRA on an embedding layer does not merge here (only linear layers do)"
    return None


def lora_updates(adapter_dir: Path) -> tuple[dict[str, dict[str, torch.Tensor]], float, bool]:
    """Module path -> {"A", "B"[, "magnitude"]}, the LoRA scale, and whether it is DoRA."""
    problem = merge_problem(adapter_dir)
    if problem:
        raise UserInputError(problem)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        key = key.removeprefix(PEFT_PREFIX)
        for suffix, part in ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".lora_magnitude_vector", "magnitude")):
            if key.endswith(suffix):
                modules.setdefault(key.removesuffix(suffix), {})[part] = tensor.float()
    return modules, scale, bool(config.get("use_dora"))


def merged_weight(weight: torch.Tensor, update: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32; with a DoRA magnitude, each output row rescaled to it."""
    merged = weight.float() + scale * (update["B"] @ update["A"])
    if "magnitude" in update:
        merged *= (update["magnitude"] / merged.norm(p=2, dim=1)).unsqueeze(1)
    return merged


def module_keys(base_path: Path, modules: dict[str, dict]) -> dict[str, str]:
    """Checkpoint key of each adapted module's weight, renamed as transformers renames on load."""
    from app.config.sections import ModelSection
    from app.model.base import build_meta_base_model
    from app.model.slices import checkpoint_index, weight_files

    model_cfg = ModelSection(path=str(base_path))
    index, converted = checkpoint_index(build_meta_base_model(model_cfg), weight_files(model_cfg))
    keys = {}
    for module in modules:
        name = f"{module}.weight"
        if name in converted or name not in index:
            raise UserInputError(f"{base_path}: no checkpoint tensor holds {name} as it is (fused or converted "
                                 "weights); merge with PEFT's merge_and_unload on a machine that holds the model")
        keys[index[name][1]] = module
    return keys


def write_merged(base_path: Path, adapter_dir: Path, out: Path, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 2 * 2**30) -> dict[str, int]:
    """Merge the adapter into the base checkpoint at `base_path` (a local directory), shard by shard.
    Returns {"files": n, "bytes": total, "merged": number of merged weights}."""
    modules, scale, _ = lora_updates(adapter_dir)
    key_of_module = module_keys(base_path, modules)
    out.mkdir(parents=True, exist_ok=False)
    files = sorted(base_path.glob("*.safetensors"))
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, names, weight_map = 0, 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(names) + 1:05d}.safetensors"
            try:
                save_file(shard, str(out / name), metadata={"format": "pt"})
            except SafetensorError as e:  # how safetensors reports a failed write, e.g. "os error 28": a full disk
                raise OSError(first_line(e)) from e
            names.append(name)
            weight_map.update({key: name for key in shard})
            shard, shard_bytes = {}, 0

    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if key in key_of_module:
                    tensor = merged_weight(tensor, modules[key_of_module[key]], scale)
                tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
                if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
                    flush()
                shard[key] = tensor.contiguous()
                shard_bytes += tensor.nbytes
                total += tensor.nbytes
    flush()
    _rename_shards(out, names, weight_map)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = json.loads((base_path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"dtype": str(dtype).removeprefix("torch.")}, indent=2))
    for extra in ("generation_config.json",):
        if (base_path / extra).exists():
            shutil.copy(base_path / extra, out / extra)
    tokenizer_home = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_path
    for name in TOKENIZER_FILES:
        if (tokenizer_home / name).exists():
            shutil.copy(tokenizer_home / name, out / name)
    return {"files": len(names), "bytes": total, "merged": len(key_of_module)}


def _rename_shards(out: Path, names: list[str], weight_map: dict[str, str]) -> None:
    """model-00001-of-0000N.safetensors, the names transformers writes (N is known only at the end)."""
    final = {name: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, name in enumerate(names)}
    for old, new in final.items():
        (out / old).rename(out / new)
    for key, name in weight_map.items():
        weight_map[key] = final[name]

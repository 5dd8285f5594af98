"""Starting from a trained adapter (`model.init_adapter`): the driver finds it (a folder, a run under
train.output_dir, or a registered version), checks here that it fits the model this run builds, and reads its
weights once; every worker then copies its own slice of each weight into its shards (app/model/adapter.py's
`load_adapter_weights`), after building the model either way (`model.load: full` or `sharded`). With
`train.objective: dpo` the same weights also fill a second, frozen adapter named `reference`: DPO's reference
model is the starting adapter, not the bare base.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from app.config.sections import LoraSection
from app.errors import UserInputError, first_line
from app.model.adapter import ADAPTER_WEIGHTS, saved_keys
from app.model.build import build_meta_lora_model

# adapter_config.json's names for what the lora section sets; a different value changes what the weights mean
_LORA_FIELDS = {"r": "r", "lora_alpha": "alpha", "use_dora": "use_dora", "use_rslora": "use_rslora"}
# settings the lora section has no key for, and the values that leave the weights meaning what they do here
_PLAIN_LORA = {"alpha_pattern": (None, {}), "rank_pattern": (None, {}), "modules_to_save": (None, []),
               "bias": (None, "none"), "lora_bias": (None, False), "layer_replication": (None,),
               "init_lora_weights": (None, True, False, "gaussian", "eva", "orthogonal")}


def adapter_settings(folder: Path, where: str) -> dict:
    """A saved PEFT LoRA adapter's adapter_config.json; one line naming `where` if it is none."""
    try:
        settings = json.loads((folder / "adapter_config.json").read_text())
        if not isinstance(settings, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise UserInputError(f"{where}: {folder / 'adapter_config.json'} is not a PEFT adapter config "
                             f"({first_line(e)})") from None
    if settings.get("peft_type", "LORA") != "LORA":
        raise UserInputError(f"{where} is a {settings['peft_type']} adapter; only LoRA adapters are loaded")
    return settings


def saved_lora_settings(folder: Path, where: str) -> LoraSection:
    """The lora section a saved adapter was trained with (without dropout: it is loaded frozen)."""
    settings = adapter_settings(folder, where)
    targets = settings.get("target_modules")
    try:
        return LoraSection(r=settings.get("r", 8), alpha=settings.get("lora_alpha", 8), dropout=0.0,
                           use_dora=bool(settings.get("use_dora")), use_rslora=bool(settings.get("use_rslora")),
                           target_modules=sorted(targets) if isinstance(targets, list | set) else targets)
    except ValidationError as e:
        first = e.errors()[0]
        raise UserInputError(f"{where}: its adapter_config.json holds settings this project cannot load (its "
                             f"{first['loc'][0]}: {first['msg']})") from None


def check_init_adapter(source: str, folder: Path, model_cfg, lora_cfg, key: str = "model.init_adapter") -> None:
    """Refuse, in one line, an adapter that does not fit this run: another kind than LoRA, other LoRA settings,
    weights for other modules or shapes (another base, other target modules), pickled weights only."""
    where = f"{key}={source}"
    settings = adapter_settings(folder, where)
    for saved, field in _LORA_FIELDS.items():
        ours = getattr(lora_cfg, field)
        if saved in settings and settings[saved] != ours:
            raise UserInputError(f"{where} was trained with lora.{field}={settings[saved]}, this run has "
                                 f"lora.{field}={ours}: set lora.{field}={settings[saved]}")
    for saved, plain in _PLAIN_LORA.items():
        if settings.get(saved) not in plain:
            raise UserInputError(f"{where} has {saved}={settings[saved]!r} in its adapter_config.json; only adapters "
                                 "with the lora section's settings alone (no per-module patterns, extra trained "
                                 "modules, biases or base-rewriting initialisations) are loaded")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise UserInputError(f"{where}: no {ADAPTER_WEIGHTS} in {folder} (pickled adapter_model.bin weights are "
                             "not loaded); save the adapter with safe_serialization")
    from safetensors import safe_open

    try:
        with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
            # full base embeddings a PEFT save adds beside an adapted embedding are not adapter weights
            found = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys() if ".base_layer." not in key}
    except Exception as e:
        raise UserInputError(f"{where}: cannot read {folder / ADAPTER_WEIGHTS} ({first_line(e)})") from None
    expected = expected_shapes(model_cfg, lora_cfg)
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        what = f"has no weight for {missing[0]}" if missing else f"has a weight this model lacks: {extra[0]}"
        adapted = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in found})
        raise UserInputError(f"{where} {what} ({len(missing)} missing, {len(extra)} unknown): it was trained on "
                             f"another base or other lora.target_modules (it adapts {adapted}); use the same "
                             "model.path and lora.target_modules")
    for key, shape in expected.items():
        if found[key] != shape:
            raise UserInputError(f"{where}: {key} is {list(found[key])}, this model needs {list(shape)}: it was "
                                 "trained on another base")


def expected_shapes(model_cfg, lora_cfg) -> dict[str, tuple[int, ...]]:
    """Saved key -> shape of every weight this run's adapter has, from a weightless (meta) copy of the model."""
    model = build_meta_lora_model(model_cfg, lora_cfg, seed=0, checkpointed=False)
    return {key: tuple(model.get_parameter(name).shape) for key, name in saved_keys(model, "default").items()}

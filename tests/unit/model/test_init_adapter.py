"""model.init_adapter in the driver: found where the user says it is, checked against the model this run
builds (one line naming what differs and the fix), its weights read. Training from it:
tests/unit/train/test_recipe.py."""

import hashlib
import re

import pytest
import torch

from app.errors import UserInputError
from app.launch.model_checks import read_init_adapter
from tests.helpers import make_config, tiny_checkpoint


def _saved_adapter(model_dir, out, **lora):
    """A PEFT LoRA adapter of `model_dir`, saved as any PEFT user saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    settings = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"} | lora
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(**settings))
    model.save_pretrained(out)
    return out


def test_an_adapter_folder_or_a_run_name_is_read_with_every_weight(embedded, tmp_path):
    folder = _saved_adapter(embedded["model"], tmp_path / "outputs" / "sft-run" / "adapter")
    for source in (str(folder), "sft-run"):  # a run name is looked up under train.output_dir
        weights, sha256 = read_init_adapter(make_config(tmp_path, embedded, f"model.init_adapter={source}"))
        assert len(weights) == 4 * 7 * 2 and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in weights)
        assert sha256 == hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert read_init_adapter(make_config(tmp_path, embedded)) == (None, None)


@pytest.mark.parametrize("lora, overrides, message", [
    ({"r": 8}, [], "was trained with lora.r=8, this run has lora.r=16: set lora.r=8"),
    ({"lora_alpha": 16}, [], "was trained with lora.alpha=16, this run has lora.alpha=32.0: set lora.alpha=16"),
    ({"target_modules": ["q_proj", "v_proj"]}, [], "has no weight for base_model.model.model.layers.0.mlp"),
    ({}, ["lora.target_modules=[q_proj]"], "has a weight this model lacks"),
    ({"alpha_pattern": {"q_proj": 64}}, [], "has alpha_pattern={'q_proj': 64} in its adapter_config.json"),
    ({"modules_to_save": ["lm_head"]}, [], "has modules_to_save="),
])
def test_an_adapter_with_other_lora_settings_is_refused_naming_the_key(embedded, tmp_path, lora, overrides, message):
    folder = _saved_adapter(embedded["model"], tmp_path / "adapter", **lora)
    with pytest.raises(UserInputError, match="^model.init_adapter=.*" + re.escape(message)):
        read_init_adapter(make_config(tmp_path, embedded, f"model.init_adapter={folder}", *overrides))


def test_an_adapter_of_another_base_or_nowhere_is_refused_in_one_line(embedded, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tiny_checkpoint("qwen2", tmp_path / "qwen2", embedded["model"])  # 2 layers, the embedded model 4
    other_adapter = _saved_adapter(other, tmp_path / "of-qwen2")
    with pytest.raises(UserInputError, match=r"has no weight for base_model.model.model.layers.2.* it was trained "
                                             r"on another base or other lora.target_modules \(it adapts \['down_proj'"):
        read_init_adapter(make_config(tmp_path, embedded, f"model.init_adapter={other_adapter}"))
    folder = _saved_adapter(embedded["model"], tmp_path / "wider")  # as if from a wider model of the same depth
    weights = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    save_file(weights | {key: torch.zeros(16, 2 * weights[key].shape[1])}, folder / "adapter_model.safetensors")
    with pytest.raises(UserInputError, match=r"q_proj.lora_A.weight is \[16, \d+\], this model needs \[16, \d+\]: "
                                             "it was trained on another base"):
        read_init_adapter(make_config(tmp_path, embedded, f"model.init_adapter={folder}"))
    with pytest.raises(UserInputError, match="^model.init_adapter=no-such-run: neither an adapter folder, a run under "
                                             ".*outputs, nor models:/NAME/VERSION$"):
        read_init_adapter(make_config(tmp_path, embedded, "model.init_adapter=no-such-run"))

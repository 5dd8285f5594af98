"""The streamed merge: base + adapter written as plain safetensors shards give PEFT's logits."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from app.errors import UserInputError
from app.model.merge import merge_problem, write_merged
from tests.helpers import tiny_checkpoint


def _random_adapter(base_dir, out, **lora):
    """An adapter whose A and B are both random (a trained adapter's update, not the zero of a fresh one)."""
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                            **lora))
    if lora.get("use_dora"):  # magnitudes away from the base's row norms, as training leaves them
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.data.mul_(1 + 0.1 * torch.rand_like(param))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("architecture,lora", [("llama", {}), ("qwen2", {"use_dora": True}),
                                               ("gpt_neox", {"use_rslora": True})])
def test_the_merged_model_gives_the_logits_of_base_plus_adapter(embedded, tmp_path, architecture, lora):
    """Qwen2 ties its embeddings; GPT-NeoX's checkpoint names its head embed_out; DoRA rescales rows."""
    base_dir = tiny_checkpoint(architecture, tmp_path / "base", embedded["model"])
    adapter = _random_adapter(base_dir, tmp_path / "adapter", **lora)
    written = write_merged(base_dir, adapter, tmp_path / "merged", torch.float32, max_shard_bytes=200_000)
    assert written["files"] > 1 and written["merged"] > 0  # several shards, as a large model's would be
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert {f.name for f in (tmp_path / "merged").glob("*.safetensors")} == set(index["weight_map"].values())

    ids = torch.randint(0, 500, (2, 24))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                         adapter).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir).eval()(input_ids=ids).logits
    assert not torch.allclose(peft, base, atol=1e-3)  # the adapter changes the model
    torch.testing.assert_close(merged, peft, atol=1e-4, rtol=1e-4)


def test_a_bf16_merge_loads_as_bf16_and_stays_close(embedded, tmp_path):
    base_dir = tiny_checkpoint("llama", tmp_path / "base", embedded["model"])
    adapter = _random_adapter(base_dir, tmp_path / "adapter")
    write_merged(base_dir, adapter, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == torch.bfloat16 and (tmp_path / "merged" / "tokenizer.json").exists()
    with pytest.raises(FileExistsError):  # never over an existing directory
        write_merged(base_dir, adapter, tmp_path / "merged")


def test_an_adapter_with_per_module_ranks_is_refused_in_one_line(embedded, tmp_path):
    base_dir = tiny_checkpoint("llama", tmp_path / "base", embedded["model"])
    adapter = _random_adapter(base_dir, tmp_path / "adapter", rank_pattern={"q_proj": 8})
    with pytest.raises(UserInputError, match="rank_pattern is set"):
        write_merged(base_dir, adapter, tmp_path / "merged")


def test_an_adapter_on_the_embeddings_is_refused_not_merged_without_them(embedded, tmp_path):
    """PEFT's embedding LoRA (lora_embedding_A/B) is no linear update: a merge that skipped it would serve another
    model; jobs.export and the server's merged engines say so instead."""
    base_dir = tiny_checkpoint("llama", tmp_path / "base", embedded["model"])
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                           LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    assert "embedding layer" in merge_problem(tmp_path / "adapter")
    with pytest.raises(UserInputError, match="LoRA on an embedding layer does not merge here"):
        write_merged(base_dir, tmp_path / "adapter", tmp_path / "merged")
    assert merge_problem(_random_adapter(base_dir, tmp_path / "linear")) is None

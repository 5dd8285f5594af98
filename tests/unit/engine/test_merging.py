"""An adapter merged into the base weights (app/engine/merging.py) answers as PEFT's forward with the adapter
active, from the untouched base at every merge (going back to an adapter gives its very weights again, with no
rounding carried over), with a reordered layer's kernel following its weight; adapters that cannot merge say why."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from app.engine.kernels import Packed, packed_forward, repack
from app.engine.merging import MergedAdapter, unmergeable
from app.engine.routing import base_view

IDS = torch.tensor([[5, 17, 42, 8, 99, 23], [7, 7, 31, 64, 2, 11]])


def _model(embedded, **lora):
    base = AutoModelForCausalLM.from_pretrained(embedded["model"], dtype=torch.float32)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, **lora)
    return get_peft_model(base, config, "policy").eval()


def _retrain(model, seed: int) -> None:
    """New LoRA weights, as a sync brings."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.2)


def _logits(module):
    with torch.no_grad():
        return module(input_ids=IDS).logits


def test_the_base_with_the_adapter_merged_answers_as_peft_with_it_active(embedded):
    model, reference = _model(embedded), _model(embedded)  # the reference is never merged into
    merged, view = MergedAdapter(model, "policy"), base_view(model.get_base_model())
    with reference.disable_adapter():
        base = _logits(reference)
    for seed in (1, 2):
        _retrain(model, seed)
        _retrain(reference, seed)
        merged.merge()
        expected = _logits(reference)
        assert not torch.allclose(expected, base, atol=1e-3)  # the adapter changes the answer
        torch.testing.assert_close(_logits(view), expected, atol=1e-4, rtol=1e-4)


def test_every_merge_starts_from_the_untouched_base(embedded):
    model = _model(embedded)
    merged = MergedAdapter(model, "policy")
    weights = lambda: [layer.get_base_layer().weight.clone() for layer in merged.layers]  # noqa: E731
    _retrain(model, 1)
    merged.merge()
    first = weights()
    for seed in (2, 3, 1):
        _retrain(model, seed)
        merged.merge()
    assert all(torch.equal(a, b) for a, b in zip(first, weights()))


def test_a_reordered_layer_multiplies_by_its_weight_after_a_repack():
    layer = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    try:
        layer.forward = packed_forward(layer, Packed(layer.weight))
    except (RuntimeError, AttributeError):
        pytest.skip("this torch build has no oneDNN reordering")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(-2.0)
        repack(layer)
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("lora, why", [({"use_dora": True}, "carries DoRA"),
                                       ({"target_modules": ["q_proj", "embed_tokens"]}, "not a plain LoRA linear")])
def test_an_adapter_that_cannot_merge_says_why(embedded, lora, why):
    base = AutoModelForCausalLM.from_pretrained(embedded["model"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, **({"target_modules": ["q_proj"]} | lora)), "policy")
    assert why in unmergeable(model, "policy")
    with pytest.raises(ValueError, match=f"the adapter cannot be merged: .*{why}"):
        MergedAdapter(model, "policy")

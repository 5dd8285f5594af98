"""Adapters sharing a micro-batch: each block of rows gets exactly what PEFT's own single-adapter forward gives it,
in training mode with dropout, and its gradients reach its adapter alone. Real PEFT on a small Llama, fp32."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.config.sections import LoraSection
from app.model.adapter import adapter_of, apply_lora
from app.model.dropout import key_lora_dropout
from app.model.row_routing import AdapterRouting
from tests.helpers import TINY

ADAPTERS = {"wide": LoraSection(r=8, alpha=16, dropout=0.2, target_modules=["q_proj", "v_proj", "down_proj"]),
            "narrow": LoraSection(r=2, alpha=4, dropout=0.1, target_modules=["q_proj", "k_proj"])}


def _model():
    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(LlamaConfig(**TINY)).float(), ADAPTERS, seed=0)
    with torch.no_grad():  # lora_B starts at zero: give every adapter a visible effect
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.2)
    return model, key_lora_dropout(model), AdapterRouting(model)


def _pass(model, key, input_ids, blocks: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with key.at(7, 3, 0, 1):
        logits = model(input_ids=input_ids).logits
        (logits.square().mean(-1).sum() / blocks).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_each_block_of_rows_runs_as_its_adapter_alone_with_the_same_dropout_and_gradients():
    """Blocks of their own rows, of unequal sizes (adapters with data of their own, a pass's last micro-batch)."""
    model, key, routing = _model()
    model.train()
    rows = {"wide": 3, "narrow": 2}
    inputs = {name: torch.randint(4, TINY["vocab_size"], (n, 12), generator=torch.Generator().manual_seed(i))
              for i, (name, n) in enumerate(rows.items())}
    alone = {}
    for name in ADAPTERS:
        routing.activate(name)
        alone[name] = _pass(model, key, inputs[name], 1)
    with routing.rows_through(list(ADAPTERS), [rows[name] for name in ADAPTERS]):
        logits, grads = _pass(model, key, torch.cat([inputs[name] for name in ADAPTERS]), 1)
    for name, block in zip(ADAPTERS, logits.split([rows[name] for name in ADAPTERS]), strict=True):
        want_logits, want_grads = alone[name]
        torch.testing.assert_close(block, want_logits, rtol=1e-5, atol=1e-5)
        mine = {n: g for n, g in grads.items() if adapter_of(n) == name}
        assert sorted(mine) == sorted(want_grads) and mine
        for n in mine:
            torch.testing.assert_close(mine[n], want_grads[n], rtol=1e-5, atol=1e-6)
    input_ids = inputs["wide"]
    # the adapters differ, and dropout is on: the same rows at another position draw other masks
    routing.activate("narrow")
    with key.at(7, 3, 0, 1):
        assert not torch.allclose(model(input_ids=input_ids).logits, alone["wide"][0])
    routing.activate("wide")
    model.zero_grad(set_to_none=True)
    with key.at(7, 4, 0, 1):
        assert not torch.allclose(model(input_ids=input_ids).logits, alone["wide"][0])


def test_rows_that_do_not_split_into_the_adapters_blocks_are_refused():
    model, key, routing = _model()
    with routing.rows_through(list(ADAPTERS)), pytest.raises(ValueError, match="do not split"):
        model(input_ids=torch.ones(3, 5, dtype=torch.long))

"""Each step takes the cheapest forward that answers it exactly: the base alone through a view without PEFT's
wrappers (sharing its weights), one adapter through PEFT's active adapter, tokens of several adapters through
PEFT's base layers with each adapter's LoRA output added to its own tokens; all give the logits PEFT's own
per-row path (`adapter_names`) gives."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM

from app.engine.routing import Router

NO_ADAPTER = "__base__"  # PEFT's row name for the base model alone


def _logits(model, ids, **adapters):
    with torch.no_grad():
        return model(input_ids=ids, **adapters).logits


def _model(embedded):
    base = AutoModelForCausalLM.from_pretrained(embedded["model"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), "alpha")
    model.add_adapter("beta", LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model.eval()


def test_the_base_view_shares_every_weight_and_has_no_adapter_in_it(embedded):
    router = Router(_model(embedded))
    assert not any(isinstance(m, BaseTunerLayer) for m in router.base.modules())
    base_weights = {p.data_ptr() for name, p in router.model.named_parameters() if "lora_" not in name}
    assert {p.data_ptr() for p in router.base.parameters()} == base_weights  # every base weight, none copied


def test_every_route_answers_as_peft_row_by_row(embedded):
    model = _model(embedded)
    router = Router(model)
    ids = torch.tensor([[5, 17, 42, 8, 99, 23], [7, 7, 31, 64, 2, 11], [12, 40, 3, 3, 77, 5]])
    per_row = _logits(model, ids, adapter_names=[NO_ADAPTER, "alpha", "beta"])
    for row, adapter in enumerate([None, "alpha", "beta"]):
        with router.route([adapter] * 6) as routed:
            assert (routed is router.base) == (adapter is None)
            torch.testing.assert_close(_logits(routed, ids[row:row + 1]), per_row[row:row + 1])
    # tokens of three sequences, each its own adapter: routed by position (the engine lays them in one row)
    with router.route([a for a in ("beta", None, "alpha") for _ in range(6)]) as routed:
        torch.testing.assert_close(_logits(routed, ids[[2, 0, 1]]), per_row[[2, 0, 1]])
    assert not torch.allclose(per_row[0], per_row[1])  # the adapters change the answer


def test_after_the_active_adapter_is_deleted_a_step_runs_the_adapter_it_names(embedded):
    """Deleting the active adapter makes each LoRA layer pick its own next one (adapters on different modules:
    the layers disagree), so the route sets the adapter a step names, whatever PEFT's model says is active."""
    model = _model(embedded)
    model.add_adapter("old", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    router, ids = Router(model), torch.tensor([[5, 17, 42, 8, 99, 23]])
    with router.route(["old"]):
        pass
    model.delete_adapter("old")  # q_proj layers now pick one of the others, v_proj layers "beta"
    router.forget()
    for name in ("alpha", "beta"):
        with router.route([name]) as routed:
            torch.testing.assert_close(_logits(routed, ids), _logits(model, ids, adapter_names=[name]))


def test_a_model_whose_forward_is_bound_by_a_hook_keeps_peft_for_the_base(embedded):
    """accelerate's offload hooks bind a module's forward to the module: a copy would run the original, so the
    base goes through PEFT with no adapter active instead."""
    model = _model(embedded)
    model.get_base_model().model.layers[1].mlp._hf_hook = object()  # what accelerate's add_hook_to_module sets
    router, ids = Router(model), torch.tensor([[5, 17, 42, 8, 99, 23]])
    assert router.base is None
    with router.route([None]) as routed:
        routed_logits = _logits(routed, ids)
    with model.disable_adapter():
        torch.testing.assert_close(routed_logits, _logits(model, ids))
    assert not torch.allclose(routed_logits, _logits(model, ids, adapter_names=["alpha"]))

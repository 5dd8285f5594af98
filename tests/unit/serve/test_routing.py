"""Each batch takes the cheapest forward that answers it exactly: the base alone through a view without
PEFT's wrappers (sharing its weights), one adapter through PEFT's active adapter, mixed rows through
`adapter_names`; all three give the logits PEFT's per-row path gives."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM

from app.serve.routing import NO_ADAPTER, Router


def _logits(model, ids, **adapters):
    with torch.no_grad():
        return model(input_ids=ids, **adapters).logits


def test_the_base_view_shares_every_weight_and_has_no_adapter_in_it(served):
    router = served[0].engine.router
    assert not any(isinstance(m, BaseTunerLayer) for m in router.base.modules())
    base_weights = {p.data_ptr() for name, p in router.model.named_parameters() if "lora_" not in name}
    assert {p.data_ptr() for p in router.base.parameters()} == base_weights  # every base weight, none copied


def test_every_route_answers_as_peft_row_by_row(served):
    router = served[0].engine.router
    ids = torch.tensor([[5, 17, 42, 8, 99, 23], [7, 7, 31, 64, 2, 11], [12, 40, 3, 3, 77, 5]])
    per_row = _logits(router.model, ids, adapter_names=[NO_ADAPTER, "noisy", "other"])
    for row, adapter in enumerate([None, "noisy", "other"]):
        model, adapters = router.route([adapter, adapter])
        assert adapters == {} and (model is router.base) == (adapter is None)
        alone = _logits(model, ids[row:row + 1].repeat(2, 1))
        torch.testing.assert_close(alone, per_row[row:row + 1].repeat(2, 1, 1))
    model, adapters = router.route(["other", None, "noisy"])
    assert adapters == {"adapter_names": ["other", NO_ADAPTER, "noisy"]}
    torch.testing.assert_close(_logits(model, ids[[2, 0, 1]], **adapters), per_row[[2, 0, 1]])
    assert not torch.allclose(per_row[0], per_row[1])  # the adapters change the answer


def test_after_the_active_adapter_is_deleted_a_batch_runs_the_adapter_it_names(embedded):
    """Deleting the active adapter makes each LoRA layer pick its own next one (adapters on different modules:
    the layers disagree), so the route sets the adapter a batch names, whatever PEFT's model says is active."""
    base = AutoModelForCausalLM.from_pretrained(embedded["model"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), "alpha")
    for name in ("old", "new"):
        model.add_adapter(name, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    router, ids = Router(model), torch.tensor([[5, 17, 42, 8, 99, 23]])
    router.route(["old"])
    model.delete_adapter("old")  # q_proj layers now pick "alpha", v_proj layers "new"
    router.forget()
    for name in ("alpha", "new"):
        routed, adapters = router.route([name])
        torch.testing.assert_close(_logits(routed, ids, **adapters), _logits(model, ids, adapter_names=[name]))


def test_a_model_whose_forward_is_bound_by_a_hook_keeps_peft_for_the_base(embedded):
    """accelerate's offload hooks bind a module's forward to the module: a copy would run the original, so the
    base goes through PEFT's per-row path instead."""
    base = AutoModelForCausalLM.from_pretrained(embedded["model"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), "alpha").eval()
    model.get_base_model().model.layers[1].mlp._hf_hook = object()  # what accelerate's add_hook_to_module sets
    router, ids = Router(model), torch.tensor([[5, 17, 42, 8, 99, 23]])
    routed, adapters = router.route([None])
    assert router.base is None and adapters == {"adapter_names": [NO_ADAPTER]}
    routed_logits = _logits(routed, ids, **adapters)
    with model.disable_adapter():
        torch.testing.assert_close(routed_logits, _logits(model, ids))
    assert not torch.allclose(routed_logits, _logits(model, ids))  # the adapter changes the answer

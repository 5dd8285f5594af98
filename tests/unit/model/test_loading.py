"""Memory-lean loading on real gloo groups: each rank builds on the meta device and reads only its shard,
and the result is the model the simple path loads whole (base weights, the adapter's initial weights,
logits); on a 2-D (HSDP) mesh, with tied embeddings at an odd world size, with DoRA, and for a
checkpoint whose keys transformers renames on load (GPT-NeoX)."""

import pytest
import torch

from app.config.loading import load_config
from app.errors import UserInputError
from app.model.adapter import base_param_name
from app.model.build import build_lora_model, build_training_model
from app.model.sharding import build_device_mesh, reshard
from app.model.slices import slice_loading_problem
from app.plan.memory import plan_memory
from app.plan.plan import Plan
from tests.helpers import run_ranks, tiny_checkpoint

OVERRIDES = ["fsdp.param_dtype=float32", "model.dtype=float32", "lora.dropout=0", "model.gradient_checkpointing=false"]
IDS = torch.arange(3, 35).reshape(2, 16)


def _load_and_score(rank: int, model_path: str, load: str, mesh: list[int] | None, out: str, *extra: str) -> None:
    cfg = load_config(None, [f"model.path={model_path}", f"model.load={load}", *OVERRIDES, *extra])
    model = build_training_model(cfg.model, cfg.lora, cfg.fsdp, build_device_mesh("cpu", mesh), 0,
                                     torch.device("cpu"))
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    reshard(model)  # the root keeps its gathered weights after a forward
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())
    if rank == 0:
        name = load + ("-hsdp" if mesh else "")
        torch.save({"logits": logits, "params": full, "local_bytes": local_bytes}, f"{out}/{name}.pt")


def _load_every_way(rank: int, world: int, model_path: str, out: str, *extra: str) -> None:
    ways = [("full", None), ("sharded", None)] + ([("sharded", [2, 1])] if world == 2 else [])
    for load, mesh in ways:
        _load_and_score(rank, model_path, load, mesh, out, *extra)


def _both_paths(tmp_path, model_path, world: int, *extra: str) -> tuple[dict, dict]:
    run_ranks(_load_every_way, world, str(model_path), str(tmp_path), *extra)
    return torch.load(tmp_path / "sharded.pt"), torch.load(tmp_path / "full.pt")


def _reference(model_path, *extra: str):
    cfg = load_config(None, [f"model.path={model_path}", *OVERRIDES, *extra])
    model = build_lora_model(cfg.model, cfg.lora, seed=0).eval()
    with torch.no_grad():
        return model, model(input_ids=IDS).logits


@pytest.mark.slow
def test_sharded_loading_builds_the_same_model_as_loading_it_whole(embedded, tmp_path):
    reference, expected = _reference(embedded["model"])
    base = {base_param_name(n): p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
    sharded, whole = _both_paths(tmp_path, embedded["model"], 2)
    hsdp = torch.load(tmp_path / "sharded-hsdp.pt")
    for name, value in sharded["params"].items():
        if "lora_B" in name:
            assert not value.any(), name  # the adapter starts as a no-op
        elif "lora_A" in name:
            assert value.abs().max() > 0 and value.std() > 0, name  # initialised, not left empty
        else:
            torch.testing.assert_close(value, base[base_param_name(name)], rtol=0, atol=0, msg=name)
        # either path starts from the same adapter for a seed
        torch.testing.assert_close(value, whole["params"][name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(sharded["logits"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole["logits"], expected, rtol=1e-5, atol=1e-5)
    assert sharded["local_bytes"] == whole["local_bytes"]  # the same shards, by either path
    cfg = load_config(None, [f"model.path={embedded['model']}", *OVERRIDES])
    planned = plan_memory(cfg).device["parameters (sharded, stored dtype)"]  # the planner's prediction
    assert abs(planned - sharded["local_bytes"]) <= 0.02 * sharded["local_bytes"]
    # HSDP [2 replicas, shard size 1]: each rank holds a whole replica, twice the bytes of a 2-way shard
    torch.testing.assert_close(hsdp["logits"], expected, rtol=1e-5, atol=1e-5)
    assert hsdp["local_bytes"] >= 1.9 * sharded["local_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("architecture, world", [("qwen2", 3), ("gemma2", 2), ("gpt_neox", 2)])
def test_tied_and_renamed_checkpoints_load_sharded_like_the_full_path(architecture, world, embedded, tmp_path):
    """qwen2 and gemma2 tie lm_head to the embedding (3 ranks: shards of uneven size); GPT-NeoX's
    checkpoint stores its head as `embed_out`, which transformers renames to `lm_head`."""
    model_path = tiny_checkpoint(architecture, tmp_path / architecture, embedded["model"])
    assert slice_loading_problem(load_config(None, [f"model.path={model_path}"]).model) is None
    reference, expected = _reference(model_path)
    sharded, whole = _both_paths(tmp_path, model_path, world)
    torch.testing.assert_close(sharded["logits"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole["logits"], expected, rtol=1e-5, atol=1e-5)
    assert sharded["params"].keys() == whole["params"].keys() == dict(reference.named_parameters()).keys()
    tied = reference.config.tie_word_embeddings
    assert (reference.get_output_embeddings().weight is reference.get_input_embeddings().weight) == tied
    planned = plan_memory(load_config(None, [f"model.path={model_path}", *OVERRIDES])).base_params
    assert planned == sum(p.numel() for p in reference.parameters() if not p.requires_grad)  # tied: counted once


@pytest.mark.slow
def test_dora_starts_from_the_row_norms_of_the_whole_base_weight(embedded, tmp_path):
    reference, expected = _reference(embedded["model"], "lora.use_dora=true")
    sharded, whole = _both_paths(tmp_path, embedded["model"], 2, "lora.use_dora=true")
    magnitudes = [n for n in sharded["params"] if "lora_magnitude_vector" in n]
    assert magnitudes
    params = dict(reference.named_parameters())
    for name in magnitudes:
        weight = params[name.split(".lora_magnitude_vector.")[0] + ".base_layer.weight"]
        torch.testing.assert_close(sharded["params"][name], weight.float().norm(dim=1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sharded["params"][name], whole["params"][name], rtol=0, atol=0)
    torch.testing.assert_close(sharded["logits"], expected, rtol=1e-5, atol=1e-5)  # DoRA starts as a no-op too


def test_a_checkpoint_missing_a_weight_is_named_in_the_driver(embedded, tmp_path):
    from safetensors.torch import load_file, save_file

    model_path = tiny_checkpoint("llama", tmp_path / "broken", embedded["model"])
    weights = load_file(model_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserInputError, match="no weight in its safetensors files for "
                                             "model.layers.1.mlp.down_proj.weight; the checkpoint does not match"):
        slice_loading_problem(load_config(None, [f"model.path={model_path}"]).model)


def test_fused_experts_make_the_plan_load_the_model_whole_and_say_why(embedded, tmp_path):
    """Mixtral's checkpoint stores each expert apart; transformers stacks them into one tensor on load,
    which no row slice of the file gives: the driver's plan switches to model.load=full and says why."""
    from app.plan.loading import loading_decision

    model_path = tiny_checkpoint("mixtral", tmp_path / "mixtral", embedded["model"])
    cfg = load_config(None, [f"model.path={model_path}", "model.load=sharded"])
    plan = Plan(cfg).decided(*loading_decision(cfg))
    assert (plan.cfg.model.load, cfg.model.load) == ("full", "sharded")
    why = plan.reasons["model.load"]
    assert why.startswith("full (transformers builds model.layers.0.mlp.experts.")
    assert why.endswith("every worker loads the whole model)") and "\n" not in why
    assert loading_decision(load_config(None, [f"model.path={embedded['model']}", "model.load=sharded"])) == ()


def test_the_meta_built_model_has_the_checkpoints_generation_config(embedded, tmp_path):
    """Gemma's and Llama 3's end-of-turn tokens are eos ids of generation_config.json only (config.json names
    one): decoding stops on them (app/train/generation.py) whichever way the model loads."""
    from transformers import GenerationConfig

    from app.model.base import build_meta_base_model

    path = tiny_checkpoint("gemma2", tmp_path / "gemma2", embedded["model"])
    GenerationConfig(bos_token_id=1, eos_token_id=[3, 7], pad_token_id=0).save_pretrained(path)
    cfg = load_config(None, [f"model.path={path}", *OVERRIDES])
    assert build_lora_model(cfg.model, cfg.lora, seed=0).generation_config.eos_token_id == [3, 7]
    assert build_meta_base_model(cfg.model).generation_config.eos_token_id == [3, 7]

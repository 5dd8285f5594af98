"""Memory-lean loading on a real 2-process gloo group: each rank builds on the meta device and reads only
its shard, and the result is the same model the simple path loads whole; also on a 2-D (HSDP) mesh."""

import torch

from app.config import load_config
from app.loading import build_sharded_lora_model, checkpoint_key
from app.memory_plan import plan_memory
from app.model import build_lora_model
from app.sharding import build_device_mesh
from tests.helpers import run_ranks

OVERRIDES = ["fsdp.param_dtype=float32", "lora.dropout=0", "model.gradient_checkpointing=false"]


def _load_both_ways(rank: int, world: int, model_path: str, out: str) -> None:
    for load, mesh in (("full", None), ("sharded", None), ("sharded", [2, 1])):
        _load_and_score(rank, model_path, load, mesh, out)


def _load_and_score(rank: int, model_path: str, load: str, mesh: list[int] | None, out: str) -> None:
    cfg = load_config(None, [f"model.path={model_path}", f"model.load={load}", *OVERRIDES])
    model = build_sharded_lora_model(cfg.model, cfg.lora, cfg.fsdp, build_device_mesh("cpu", mesh), 0,
                                     torch.device("cpu"))
    ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())
    if rank == 0:
        name = load + ("-hsdp" if mesh else "")
        torch.save({"logits": logits, "params": full, "local_bytes": local_bytes}, f"{out}/{name}.pt")


def test_sharded_loading_builds_the_same_model_as_loading_it_whole(embedded, tmp_path):
    cfg = load_config(None, [f"model.path={embedded['model']}", *OVERRIDES])
    reference = build_lora_model(cfg.model, cfg.lora, seed=0).eval()
    base = {checkpoint_key(n): p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
    with torch.no_grad():  # computed in fp32 from the bf16 weights, as fsdp.param_dtype=float32 does
        expected = reference.float()(input_ids=torch.arange(3, 35).reshape(2, 16)).logits

    run_ranks(_load_both_ways, 2, str(embedded["model"]), str(tmp_path))
    sharded, whole, hsdp = (torch.load(tmp_path / f"{name}.pt") for name in ("sharded", "full", "sharded-hsdp"))
    for name, value in sharded["params"].items():
        if "lora_B" in name:
            assert not value.any(), name  # the adapter starts as a no-op
        elif "lora_A" in name:
            assert value.abs().max() > 0 and value.std() > 0, name  # initialised, not left empty
        else:
            torch.testing.assert_close(value, base[checkpoint_key(name)].to(value.dtype), rtol=0, atol=0, msg=name)
    torch.testing.assert_close(sharded["logits"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole["logits"], expected, rtol=1e-5, atol=1e-5)
    assert sharded["local_bytes"] == whole["local_bytes"]  # the same shards, by either path
    planned = plan_memory(cfg).device["parameters (sharded, stored dtype)"]  # the planner's prediction
    assert abs(planned - sharded["local_bytes"]) <= 0.02 * sharded["local_bytes"]
    # HSDP [2 replicas, shard size 1]: each rank holds a whole replica, twice the bytes of a 2-way shard
    torch.testing.assert_close(hsdp["logits"], expected, rtol=1e-5, atol=1e-5)
    assert hsdp["local_bytes"] >= 1.9 * sharded["local_bytes"]

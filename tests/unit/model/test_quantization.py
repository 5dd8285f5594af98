"""QLoRA's NF4 base (model.quantization=nf4) on real gloo groups: the format's error bound, both loading paths
giving the same NF4 bytes, the all-gathered shards being the unsharded quantized weight, the loss over the NF4
base being the loss over its dequantized weights, and LoRA training over it."""

import pytest
import torch

from app.config.loading import load_config
from app.errors import UserInputError
from app.launch.model_checks import check_nf4_shapes
from app.model.build import build_lora_model, build_training_model
from app.model.quantization import NF4_BLOCK, is_nf4, quantizable_linears, quantize_nf4, scaler_block_size
from app.model.sharding import build_device_mesh, decoder_layers, reshard, trainable_parameters
from app.plan.memory import plan_memory
from tests.helpers import run_ranks

OVERRIDES = ["fsdp.param_dtype=float32", "model.dtype=float32", "lora.dropout=0", "model.gradient_checkpointing=false"]
IDS = torch.arange(3, 35).reshape(2, 16)
NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def test_nf4_round_trip_error_is_within_the_formats_bound():
    torch.manual_seed(0)
    weight = torch.randn(256, 128) * 0.02
    weight[3, :64] *= 40  # an outlier block: its own scale, the others unaffected
    back = quantize_nf4(weight, shards=1).get_original_weight()
    blocks, errors = weight.reshape(-1, NF4_BLOCK), (back - weight).reshape(-1, NF4_BLOCK).abs()
    scales = blocks.abs().amax(1, keepdim=True)
    # nearest of 16 levels: at most half the widest gap (0.7230 -> 1.0) of the block's scale; the int8 scale
    # adds at most two of its 256 steps over the spread of the scales
    bound = scales * (1.0 - 0.7230) / 2 + 2 * (scales.max() - scales.min()) / 256 + 1e-7
    assert (errors <= bound).all()
    assert (errors.pow(2).mean() / blocks.pow(2).mean()).sqrt() < 0.15  # ~0.1 relative RMS: 4 bits


def test_the_double_quantization_group_fits_the_shards():
    assert scaler_block_size((4096, 4096), 8) == 256  # real shapes: QLoRA's group
    assert scaler_block_size((64, 128), 2) == 64  # 128 blocks over 2 ranks: groups of 64
    assert scaler_block_size((63, 128), 2) is None  # rows that do not split
    assert scaler_block_size((3, 10), 1) is None  # not whole blocks


def _nf4_parts(model) -> dict[str, list[torch.Tensor]]:
    return {name: [getattr(p.to_local(), part).clone() for part in NF4_PARTS]
            for name, p in model.named_parameters() if is_nf4(p)}


def _build(model_path: str, load: str):
    cfg = load_config(None, [f"model.path={model_path}", f"model.load={load}", "model.quantization=nf4", *OVERRIDES])
    return build_training_model(cfg.model, cfg.lora, cfg.fsdp, build_device_mesh("cpu"), 0, torch.device("cpu"))


def _train(model, steps: int) -> list[float]:
    """`steps` AdamW steps of the LoRA weights on IDS; the loss of each."""
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _dequantize_in_place(model, shards: int) -> None:
    """Each quantizable weight replaced by its NF4 round trip (as quantized for `shards` ranks)."""
    with torch.no_grad():
        for layer in decoder_layers(model):
            for linear in quantizable_linears(layer).values():
                linear.weight.copy_(quantize_nf4(linear.weight, shards=shards).get_original_weight())


def _quantize_load_and_train(rank: int, world: int, model_path: str, out: str) -> None:
    full, sharded = _build(model_path, "full"), _build(model_path, "sharded")
    nf4_full, nf4_sharded = _nf4_parts(full), _nf4_parts(sharded)
    assert nf4_full.keys() == nf4_sharded.keys() and len(nf4_full) == 4 * 7  # 4 layers x q k v o gate up down
    for name in nf4_full:
        for a, b in zip(nf4_full[name], nf4_sharded[name]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # the same NF4 bytes either way
    layer = decoder_layers(sharded)[0]
    layer.unshard()  # FSDP2's all-gather of the NF4 shards (4-bit codes and scales)
    gathered = {name: linear.weight.get_original_weight().clone()
                for name, linear in quantizable_linears(layer).items()}
    layer.reshard()
    with torch.no_grad():
        loss_nf4 = sharded(input_ids=IDS, labels=IDS).loss.item()
    reshard(sharded)
    losses = _train(sharded, steps=8)
    reshard(sharded)
    assert all(is_nf4(p) for name, p in sharded.named_parameters() if name in nf4_full)  # still NF4 after steps
    if rank == 0:
        torch.save({"gathered": gathered, "loss_nf4": loss_nf4, "losses": losses,
                    "local_bytes": sum(sum(t.numel() * t.element_size() for t in parts[:3])
                                       for parts in nf4_sharded.values())}, f"{out}/nf4.pt")


@pytest.mark.slow
def test_an_nf4_base_loads_alike_both_ways_gathers_to_its_quantized_weight_and_trains(embedded, tmp_path):
    run_ranks(_quantize_load_and_train, 2, str(embedded["model"]), str(tmp_path))
    result = torch.load(tmp_path / "nf4.pt")
    cfg = load_config(None, [f"model.path={embedded['model']}", *OVERRIDES])
    plain = build_lora_model(cfg.model, cfg.lora, seed=0).eval()
    layer0 = quantizable_linears(decoder_layers(plain)[0])
    for name, weight in result["gathered"].items():  # all-gathered shards = the whole weight quantized alone
        expected = quantize_nf4(layer0[name].weight.detach(), shards=2).get_original_weight()
        torch.testing.assert_close(weight, expected, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        exact = plain(input_ids=IDS, labels=IDS).loss.item()
        _dequantize_in_place(plain, shards=2)
        dequantized = plain(input_ids=IDS, labels=IDS).loss.item()
    assert result["loss_nf4"] == pytest.approx(dequantized, rel=1e-5)  # NF4 computes its dequantized weights
    assert result["loss_nf4"] != pytest.approx(exact, rel=1e-4)  # ... which are not the original ones
    assert result["losses"][-1] < 0.7 * result["losses"][0]  # LoRA learns over the 4-bit base
    nf4_cfg = load_config(None, [f"model.path={embedded['model']}", "model.quantization=nf4", *OVERRIDES])
    planned, unquantized = (plan_memory(c).device for c in (nf4_cfg, cfg))
    key = "parameters (sharded, stored dtype)"
    assert planned[key] < 0.5 * unquantized[key]
    linears = sum(w.numel() for layer in decoder_layers(plain) for w in
                  (lin.weight for lin in quantizable_linears(layer).values()))
    assert result["local_bytes"] == pytest.approx(linears * (0.5 + 1 / NF4_BLOCK) / 2, rel=0.01)  # ~4.1 bits


def _one_rank(rank: int, world: int, model_path: str, out: str) -> None:
    model = _build(model_path, "sharded")
    nf4 = [p for p in model.parameters() if is_nf4(p)]
    assert len(nf4) == 4 * 7 and all(type(p).__name__ == "NF4Tensor" for p in nf4)  # whole, not DTensors
    torch.save(_train(model, steps=3), f"{out}/one_rank.pt")


@pytest.mark.slow
def test_on_one_rank_the_nf4_weights_stay_whole_and_train(embedded, tmp_path):
    """A shard group of one rank (1 worker, or HSDP with shard size 1): FSDP2's one-rank path cannot gather
    NF4's several tensors, and there is nothing to shard, so the NF4 weights are left out of FSDP2."""
    run_ranks(_one_rank, 1, str(embedded["model"]), str(tmp_path))
    losses = torch.load(tmp_path / "one_rank.pt")
    cfg = load_config(None, [f"model.path={embedded['model']}", *OVERRIDES])
    plain = build_lora_model(cfg.model, cfg.lora, seed=0).eval()
    _dequantize_in_place(plain, shards=1)
    with torch.no_grad():
        assert losses[0] == pytest.approx(plain(input_ids=IDS, labels=IDS).loss.item(), rel=1e-5)
    assert losses[-1] < losses[0]


def test_nf4_shapes_that_do_not_split_over_the_workers_are_refused_before_any_worker(embedded):
    cfg = load_config(None, [f"model.path={embedded['model']}", "model.quantization=nf4", "scaling.num_workers=3",
                             "train.global_batch_size=12"])
    with pytest.raises(UserInputError, match=r"model.quantization=nf4: .*layers.0.self_attn.q_proj.* 3 shards"):
        check_nf4_shapes(cfg)
    with pytest.raises(ValueError, match="lora.use_dora=true with model.quantization=nf4"):
        load_config(None, ["model.quantization=nf4", "lora.use_dora=true"])

"""FSDP2 on a real 2-process gloo group (no Ray): decoder layers found generically, adapter gathered whole."""

from pathlib import Path

import pytest
import torch

from app.config.loading import load_config
from app.model.base import load_tokenizer
from app.model.build import build_lora_model
from app.model.sharding import build_device_mesh, decoder_layers, shard_model, trainable_parameters
from app.train.checkpoint import gather_trainable_state, save_adapter
from tests.helpers import run_ranks


def _train_and_export(rank: int, world: int, model_path: str, out: str) -> None:
    cfg = load_config(None, [f"model.path={model_path}", "fsdp.param_dtype=float32", "lora.dropout=0"])
    model = build_lora_model(cfg.model, cfg.lora, seed=0)
    shard_model(model, build_device_mesh("cpu"), cfg.fsdp)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # lora_B starts at zero: two steps make every element non-zero
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(local, f"{out}/rank{rank}.pt")
    state = gather_trainable_state(model)
    if rank == 0:
        save_adapter(model, state, Path(out) / "adapter", load_tokenizer(cfg.model))


def test_decoder_layers_are_found_from_the_model_not_its_class_name(embedded):
    cfg = load_config(None, [f"model.path={embedded['model']}"])
    model = build_lora_model(cfg.model, cfg.lora, seed=0)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert {type(layer).__name__ for layer in layers} == {"LlamaDecoderLayer"}


@pytest.mark.slow
def test_adapter_is_gathered_from_every_shard_and_reloads_with_peft(embedded, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_ranks(_train_and_export, 2, str(embedded["model"]), str(tmp_path))
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(embedded["model"]),
                                         tmp_path / "adapter")
    params = dict(reloaded.named_parameters())
    lora_b = [n for n in shards[0] if "lora_B" in n]
    assert lora_b, "no LoRA B matrices were trained"
    for name in shards[0]:
        whole = torch.cat([shards[0][name], shards[1][name]])  # FSDP2 shards dim 0 across ranks
        assert torch.equal(params[name].detach(), whole), name
    # the second rank's half of lora_B is what a rank-0-only save would have lost
    assert all(shards[1][n].abs().sum() > 0 for n in lora_b)


def _export_after_an_eval_forward(rank: int, world: int, model_path: str, out: str) -> None:
    cfg = load_config(None, [f"model.path={model_path}", "model.dtype=float32", "fsdp.param_dtype=bfloat16",
                             "fsdp.reshard_after_forward=false", "lora.dropout=0"])
    model = shard_model(build_lora_model(cfg.model, cfg.lora, seed=0), build_device_mesh("cpu"), cfg.fsdp)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # what evaluation and sample generation do before the export
        model(input_ids=ids)
    registered = {n: str(p.dtype) for n, p in model.named_parameters() if p.requires_grad}
    state = gather_trainable_state(model)
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save({"shards": shards, "registered": registered, "adapter": state}, f"{out}/export-rank{rank}.pt")


@pytest.mark.slow
def test_the_adapter_is_exported_from_the_fp32_shards_after_a_bf16_eval_forward(embedded, tmp_path):
    """bf16 compute without resharding after forward: an eval forward leaves bf16 copies registered as
    the parameters; the exported adapter must still be the fp32 master weights, bit for bit."""
    run_ranks(_export_after_an_eval_forward, 2, str(embedded["model"]), str(tmp_path))
    ranks = [torch.load(tmp_path / f"export-rank{r}.pt") for r in range(2)]
    assert "torch.bfloat16" in ranks[0]["registered"].values()  # the situation the export must survive
    adapter = ranks[0]["adapter"]
    assert adapter.keys() == ranks[0]["shards"].keys()
    for name, value in adapter.items():
        whole = torch.cat([ranks[0]["shards"][name], ranks[1]["shards"][name]])
        assert value.dtype == torch.float32 and torch.equal(value, whole), name


def _grads_with_and_without_compile(rank: int, world: int, model_path: str, out: str) -> None:
    cfg = load_config(None, [f"model.path={model_path}", "fsdp.param_dtype=float32", "lora.dropout=0",
                             "model.gradient_checkpointing=false"])
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(rank))
    results = {}
    for compiled in (False, True):
        model = build_lora_model(cfg.model, cfg.lora, seed=0)
        for name, p in model.named_parameters():  # lora_B starts at zero: give every LoRA weight a gradient
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        shard_model(model, build_device_mesh("cpu"), cfg.fsdp, compile_layers=compiled)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[compiled] = (loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()
                                           if p.grad is not None})
    if rank == 0:
        torch.save(results, f"{out}/compiled.pt")


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones(embedded, tmp_path):
    """model.compile: each decoder layer torch.compile'd after fully_shard gives the same loss and gradients."""
    run_ranks(_grads_with_and_without_compile, 2, str(embedded["model"]), str(tmp_path))
    results = torch.load(tmp_path / "compiled.pt")
    (eager_loss, eager), (compiled_loss, compiled) = results[False], results[True]
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert compiled.keys() == eager.keys() and any("lora_A" in n for n in compiled)
    for name, grad in compiled.items():
        torch.testing.assert_close(grad, eager[name], rtol=1e-3, atol=1e-5 * eager[name].abs().max().item(),
                                   msg=name)


def _activation_bytes_saved_for_backward(model, ids: torch.Tensor) -> int:
    """What one training forward saves for backward, less the weights (alive anyway): what activation
    checkpointing exists to shrink. (Tensors saved inside a checkpointed region go to its own hooks.)"""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        weights = {id(p) for p in model.parameters()}  # the gathered ones while a layer runs
        if id(tensor) not in weights and id(tensor._base) not in weights:
            saved.append(tensor.nbytes)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(saved)


def _checkpointing_under_compile(rank: int, world: int, model_path: str, out: str) -> None:
    ids = torch.randint(4, 300, (4, 64), generator=torch.Generator().manual_seed(rank))
    saved = {}
    for checkpointing, compiled in ((True, False), (True, True), (False, True)):
        cfg = load_config(None, [f"model.path={model_path}", "fsdp.param_dtype=float32", "lora.dropout=0",
                                 f"model.gradient_checkpointing={str(checkpointing).lower()}"])
        model = build_lora_model(cfg.model, cfg.lora, seed=0)
        shard_model(model, build_device_mesh("cpu"), cfg.fsdp, compile_layers=compiled).train()
        saved[checkpointing, compiled] = _activation_bytes_saved_for_backward(model, ids)
    torch.save(saved, f"{out}/checkpointing.pt")


@pytest.mark.slow
@pytest.mark.extended  # compiled layers training as eager ones do runs in make test (above)
def test_compiled_layers_keep_activation_checkpointing(embedded, tmp_path):
    """model.compile with gradient_checkpointing: transformers checkpoints only the outermost forward of a
    layer's class, so what is compiled must be that one. Compiled layers then save about the activations
    eager checkpointed ones do (their inputs besides), far fewer than compiled layers without checkpointing.
    (Counting the checkpoint calls would not do: a counter makes torch.compile recompile at each call.)"""
    run_ranks(_checkpointing_under_compile, 1, str(embedded["model"]), str(tmp_path))
    saved = torch.load(tmp_path / "checkpointing.pt")
    assert saved[True, True] < 1.2 * saved[True, False]
    assert saved[True, True] < 0.5 * saved[False, True]

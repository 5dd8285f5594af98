"""The chunked cross-entropy gives the plain loss and the plain gradients, alone and under FSDP2."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from app.config.schema import load_config
from app.data.formatting import IGNORE_INDEX
from app.model.build import build_lora_model
from app.model.sharding import build_device_mesh, shard_model
from app.train.loss import chunkable_head, summed_token_loss
from tests.helpers import ARCHITECTURES, TINY, run_ranks


def _batch(seed: int = 0, vocab: int = TINY["vocab_size"]) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (3, 20), generator=g)
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX  # a prompt
    labels[2, 15:] = IGNORE_INDEX  # padding
    return {"input_ids": ids, "labels": labels}


def _assert_same_grads(grads: dict, expected: dict) -> None:
    """Equal up to float reassociation (chunks sum in another order)."""
    assert grads.keys() == expected.keys() and len(grads) > 0
    for name, grad in grads.items():
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def _loss_and_grads(model, batch, chunk_tokens: int) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = summed_token_loss(model, batch, chunk_tokens)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma2", "phi3", "gpt_neox"])
def test_the_chunked_loss_equals_the_plain_loss_and_its_lora_gradients(architecture):
    """qwen2: a tied head; gemma2: softcapped logits. Chunks of 7 positions: the last one is short."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, **(TINY | ARCHITECTURES[architecture]))
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert chunkable_head(model) is not None
    plain_loss, plain_grads = _loss_and_grads(model, _batch(), chunk_tokens=0)
    loss, grads = _loss_and_grads(model, _batch(), chunk_tokens=7)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    _assert_same_grads(grads, plain_grads)


def test_a_trained_head_gets_the_plain_gradient_too():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), dtype=torch.float32)
    plain_loss, plain_grads = _loss_and_grads(model, _batch(1), chunk_tokens=0)
    loss, grads = _loss_and_grads(model, _batch(1), chunk_tokens=16)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    _assert_same_grads(grads, plain_grads)  # the head's, the embeddings', every layer's


def _sharded_grads(rank: int, world: int, model_path: str, out: str) -> None:
    cfg = load_config(None, [f"model.path={model_path}", "fsdp.param_dtype=float32", "lora.dropout=0",
                             "fsdp.reshard_after_forward=true"])
    model = build_lora_model(cfg.model, cfg.lora, seed=0)
    for p in model.parameters():  # lora_B starts at zero: give every LoRA weight a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    shard_model(model, build_device_mesh("cpu"), cfg.fsdp)
    results = {}
    for chunk_tokens in (0, 5):
        loss, grads = _loss_and_grads(model, _batch(rank, model.config.vocab_size), chunk_tokens)
        results[chunk_tokens] = (loss, {n: g.full_tensor() for n, g in grads.items()})
    if rank == 0:
        torch.save(results, Path(out) / "grads.pt")


def test_under_fsdp2_the_chunked_loss_gives_the_same_reduced_gradients(embedded, tmp_path):
    run_ranks(_sharded_grads, 2, str(embedded["model"]), str(tmp_path))
    results = torch.load(tmp_path / "grads.pt")
    (plain_loss, plain), (loss, chunked) = results[0], results[5]
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    _assert_same_grads(chunked, plain)

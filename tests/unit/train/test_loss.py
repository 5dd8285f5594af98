"""The chunked cross-entropy gives the plain loss and the plain gradients, alone and under FSDP2."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from app.config.loading import load_config
from app.data.chat import IGNORE_INDEX
from app.model.build import build_lora_model
from app.model.sharding import build_device_mesh, shard_model
from app.train.loss import ChunkedLinearCrossEntropy, chunkable_head, sampled_token_logps, summed_token_loss
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


def test_the_chunked_head_gives_the_plain_log_probs_and_entropies_at_the_targets_and_zero_elsewhere():
    """Only target positions go through the chunked head (a prompt's or a pad's logits weigh nothing): what
    GRPO reads, the sampled tokens' log-probabilities and the policy's entropy, is the plain loss's there."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **(TINY | ARCHITECTURES["llama"]))
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    batch = _batch()
    targets = batch["labels"][:, 1:] != IGNORE_INDEX
    with torch.no_grad():
        plain_logps, plain_entropy = sampled_token_logps(model, batch, 0, temperature=0.7)
        logps, entropy = sampled_token_logps(model, batch, 7, temperature=0.7)
    torch.testing.assert_close(logps[targets], plain_logps[targets])
    torch.testing.assert_close(entropy[targets], plain_entropy[targets])
    assert not logps[~targets].any() and not entropy[~targets].any() and plain_entropy[~targets].all()


@pytest.mark.parametrize("architecture,sizes", [("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64, "dropout": 0.0}),
                                                ("recurrent_gemma", {"attention_window_size": 16, "lru_width": 64})])
def test_the_chunked_loss_is_the_models_loss_where_the_body_is_bypassed_or_logits_capped_otherwise(architecture, sizes):
    """OPT's CausalLM calls its decoder, not its base model (a hook on the base model found no hidden states:
    KeyError); Recurrent Gemma caps logits under its own config name (left uncapped, the loss was off)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, **(TINY | sizes))
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    plain_loss, plain_grads = _loss_and_grads(model, _batch(), chunk_tokens=0)
    loss, grads = _loss_and_grads(model, _batch(), chunk_tokens=7)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    _assert_same_grads(grads, plain_grads)


class _HeadWeightOnly(LlamaForCausalLM):
    """A forward that multiplies by the head's weight itself instead of calling the head (as remote code may)."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(logits=F.linear(hidden, self.lm_head.weight))


def test_where_the_head_is_not_called_the_chunked_loss_falls_back_to_the_plain_loss_with_one_warning(capsys):
    torch.manual_seed(0)
    model = _HeadWeightOnly(LlamaConfig(**TINY)).float()
    plain_loss, plain_grads = _loss_and_grads(model, _batch(2), chunk_tokens=0)
    capsys.readouterr()
    losses = [_loss_and_grads(model, _batch(2), chunk_tokens=7) for _ in range(2)]
    assert [loss for loss, _ in losses] == [plain_loss, plain_loss]
    _assert_same_grads(losses[1][1], plain_grads)
    assert capsys.readouterr().err.splitlines() == [
        "warning: train.loss_chunk_tokens: _HeadWeightOnly does not hand its output head the final hidden states "
        "once per forward; it takes the plain loss (full logits)"]
    assert chunkable_head(model) is None  # the next micro-batch goes straight to the plain loss


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


@pytest.mark.slow
def test_under_fsdp2_the_chunked_loss_gives_the_same_reduced_gradients(embedded, tmp_path):
    run_ranks(_sharded_grads, 2, str(embedded["model"]), str(tmp_path))
    results = torch.load(tmp_path / "grads.pt")
    (plain_loss, plain), (loss, chunked) = results[0], results[5]
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    _assert_same_grads(chunked, plain)


def test_the_chunked_loss_applies_the_loss_scale_in_fp32_not_rounded_to_bf16():
    """A bf16 model: the step backpropagates loss x (world size / N). With that scale rounded to bf16 (1/3 is
    0.2% off there) every gradient, and so where clipping starts, would be off by as much."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 32, generator=g).bfloat16()
    weight = (torch.randn(512, 32, generator=g) * 0.3).bfloat16()
    labels = torch.randint(0, 512, (256,), generator=g)
    scale = torch.tensor(1 / 3, dtype=torch.float64)  # what scaled_micro_batch_loss multiplies by for N = 3
    assert abs(scale.bfloat16().item() * 3 - 1) > 1e-3  # this scale does round badly in bf16
    grads = []
    for factor in (1.0, scale):
        h = hidden.clone().requires_grad_()
        (ChunkedLinearCrossEntropy.apply(h, weight, labels, 64, None)[0].sum() * factor).backward()
        grads.append(h.grad.double())
    unscaled, scaled = grads
    kept = unscaled != 0
    ratio = (scaled[kept] / (unscaled[kept] * scale)).mean().item()
    assert ratio == pytest.approx(1, abs=2e-4)  # rounded once to bf16, without bias

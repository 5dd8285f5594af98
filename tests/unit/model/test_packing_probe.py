"""Every causal LM transformers ships, built tiny: the packing probe decides how (or whether) its packed rows
keep records apart, and a LoRA training step with the chunked loss runs on it (packed rows where the probe
allows them), finite and equal to the plain loss.

Skipped in transformers 5.23 (42 of 189; -rs prints each reason):
- over 50M parameters at 2 layers (towers or per-layer tables the small sizes do not reach): blt, dots3_note,
  emu3, fuyu, gemma3, gemma4, gemma4_text, gemma4_unified, git, got_ocr2, llama4, mllama,
  moss_transcribe_diarize, phi4_multimodal, qwen3_5, qwen3_5_moe;
- no 2-layer build from default values (required settings, per-layer patterns, timm): cohere_compass_text,
  dbrx, gemma3n, gemma3n_text, gemma4_assistant, gemma4_unified_assistant, gpt_neo, lfm2_moe, mamba2,
  mimo_v2_flash, musicgen, musicgen_melody, qwen4_exp, reformer, xlnet, xmod, zamba, zamba2, zaya;
- PEFT's LoRA on all linear layers fails (the probe ran): deepseek_v4, falcon_h1, falcon_mamba, llama4_text,
  mamba, nemotron_h, phimoe.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from app.data.chat import IGNORE_INDEX
from app.model.packing_probe import SMALL_SIZES, packing_isolation
from app.model.segment_attention import use_segments_on_cpu
from app.train.loss import summed_token_loss

pytestmark = pytest.mark.slow  # make test runs it, make test-fast does not


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models, whose ops are too small to split: under `make test` two test processes share two cores,
    and a second intra-op thread each only contends (the module took four times longer)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

LENGTHS = (7, 12, 5)


def tiny_model(model_type: str):
    """A 2-layer random fp32 model of `model_type`, built from AutoConfig.for_model with small sizes for the
    size fields its config has (token ids inside the small vocabulary); skips the test, with the reason, where
    that does not build or run."""
    try:
        defaults = AutoConfig.for_model(model_type)
        values = defaults.to_dict()
        small = {k: v for k, v in SMALL_SIZES.items() if k in values or k in type(defaults).attribute_map}
        token_ids = {k: 1 for k, v in values.items() if k.endswith("token_id") and type(v) is int and v >= 256}
        config = AutoConfig.for_model(model_type, **small, **token_ids)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > 50_000_000:
            pytest.skip(f"{model_type}: {size / 1e6:.0f}M parameters at 2 layers (sizes the small kwargs do not reach)")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model(input_ids=torch.tensor([[4, 5, 6]]), use_cache=False)
    except pytest.skip.Exception:
        raise
    except Exception as e:
        pytest.skip(f"{model_type} does not build tiny: {type(e).__name__}: {str(e).strip()[:200]}")
    return config, model


def _batch(vocab: int, packed: bool) -> dict:
    """Three records: in one packed row (restarting positions, first labels masked), or one per row."""
    g = torch.Generator().manual_seed(1)
    records = [torch.randint(4, vocab, (n,), generator=g) for n in LENGTHS]
    if packed:
        ids = torch.cat(records)[None]
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        labels = ids.clone()
        labels[positions == 0] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, record in enumerate(records):
        ids[row, :len(record)] = labels[row, :len(record)] = record
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_the_probe_decides_and_a_chunked_loss_step_trains(model_type):
    config, model = tiny_model(model_type)
    isolation = packing_isolation(config)
    assert isolation.feed in ("positions", "mask", None)
    print(f"{model_type}: packed rows fed {isolation.feed or 'never (refused)'}; gap with positions alone "
          f"{isolation.gap:.1e}{'; ' + isolation.problem if isolation.problem else ''}")
    vocab = min(m.weight.shape[0] for m in (model.get_input_embeddings(), model.get_output_embeddings()))
    batch = _batch(vocab, packed=isolation.feed is not None)
    try:
        model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False)).eval()
        with torch.no_grad():  # eval(): no dropout, so the chunked and the plain loss see the same forward
            plain = summed_token_loss(model, batch).item()
    except Exception as e:
        pytest.skip(f"{model_type}: PEFT LoRA on all linear layers fails: {type(e).__name__}: {str(e).strip()[:200]}")
    loss = summed_token_loss(model, batch, chunk_tokens=8)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # experts no token chose get none
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert loss.item() == pytest.approx(plain, rel=1e-5)
    if isolation.feed is not None:  # the CPU's per-record attention, where the model takes it: the same loss
        use_segments_on_cpu(model.get_base_model())
        with torch.no_grad():
            assert summed_token_loss(model, batch, chunk_tokens=8).item() == pytest.approx(plain, rel=1e-5)

"""The CPU's per-record attention over packed rows (app/model/segment_attention.py) gives the block-causal
mask's loss and gradients, for records short (matmuls) and long (SDPA), plain and grouped-query heads; a layer
whose attention is more than causal (a sliding window) keeps the mask."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from app.data.chat import IGNORE_INDEX
from app.model import segment_attention
from app.model.segment_attention import (
    MATMUL_UP_TO,
    SEGMENTS_KERNEL,
    WHOLE_ROW_UP_TO,
    segment_lengths,
    use_segments_on_cpu,
)
from app.train.loss import summed_token_loss
from tests.helpers import ARCHITECTURES, TINY

causal_attention = segment_attention.causal_attention  # the real one, which the test's spy calls

LENGTHS = [[5, 17, 1, MATMUL_UP_TO + 20, 12], [30, 8, 200, 9]]  # records short and long, a lone token


def _packed_batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([[p for n in row for p in range(n)] for row in LENGTHS])
    ids = torch.randint(4, vocab, positions.shape, generator=g)
    labels = ids.clone()
    labels[positions == 0] = IGNORE_INDEX  # a record's first token has no context
    labels[1, -200:-150] = IGNORE_INDEX  # a prompt
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _loss_and_grads(model, batch) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = summed_token_loss(model, batch, chunk_tokens=64)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_segment_lengths_are_read_from_restarting_positions():
    assert segment_lengths(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 5, 0, 1]])) == [
        [3, 2, 4], [1, 6, 2]]


@pytest.mark.parametrize("architecture,window,per_record", [("llama", None, True), ("qwen2", None, True),
                                                            ("mistral", 64, False)])
def test_per_record_attention_gives_the_masked_rows_loss_and_gradients(architecture, window, per_record, monkeypatch):
    """qwen2: grouped-query heads; mistral with a sliding window shorter than a record: the mask is kept."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, **(TINY | ARCHITECTURES[architecture] | {"sliding_window": window}))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    batch = _packed_batch(config.vocab_size)
    masked_loss, masked_grads = _loss_and_grads(model, batch)
    use_segments_on_cpu(model)
    assert model.config._attn_implementation == SEGMENTS_KERNEL
    records = []
    monkeypatch.setattr(segment_attention, "causal_attention", lambda q, *rest: records.append(q.shape[2]) or
                        causal_attention(q, *rest))
    loss, grads = _loss_and_grads(model, batch)
    assert sorted(set(records)) == (sorted({n for row in LENGTHS for n in row}) if per_record else [])
    assert loss == pytest.approx(masked_loss, rel=1e-5)
    assert grads.keys() == masked_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, masked_grads[name], rtol=1e-4, atol=1e-6 * masked_grads[name].abs().max(),
                                   msg=name)



@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_short_rows_attend_whole_under_the_mask_by_matmuls(architecture, monkeypatch):
    """Rows of at most WHOLE_ROW_UP_TO tokens: matmuls under the block-causal mask for the whole micro-batch (a few
    ops for every row, where the CPU's SDPA kernel's backward is slow), SDPA's loss and gradients; longer rows
    attend per record."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, **(TINY | ARCHITECTURES[architecture]))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    positions = torch.tensor([[p for n in (10, 1, 20, WHOLE_ROW_UP_TO - 31) for p in range(n)]] * 3)
    ids = torch.randint(4, config.vocab_size, positions.shape, generator=torch.Generator().manual_seed(1))
    short = {"input_ids": ids, "labels": ids.masked_fill(positions == 0, IGNORE_INDEX), "position_ids": positions}
    masked_loss, masked_grads = _loss_and_grads(model, short)
    use_segments_on_cpu(model)
    records = []
    monkeypatch.setattr(segment_attention, "causal_attention", lambda q, *rest: records.append(q.shape[2]) or
                        causal_attention(q, *rest))
    loss, grads = _loss_and_grads(model, short)
    assert records == [] and loss == pytest.approx(masked_loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, masked_grads[name], rtol=1e-4, atol=1e-6 * masked_grads[name].abs().max(),
                                   msg=name)
    longer = {key: torch.cat([value, value[:, :2]], dim=1) for key, value in short.items()}
    _loss_and_grads(model, longer)
    assert sorted(set(records)) == [1, 2, 10, 20, WHOLE_ROW_UP_TO - 31]

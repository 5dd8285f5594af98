"""Packing: records share a row but train as if alone (positions restart, attention stays inside each)."""

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from app.data.formatting import IGNORE_INDEX
from app.data.packing import first_fit, pack_rows, unpacked_rows
from app.train.loss import summed_token_loss, target_token_count
from tests.helpers import ARCHITECTURES, TINY

ROW = 48


def _token_rows(lengths: list[int], sources: list[int] | None = None, seed: int = 0) -> pa.Table:
    """Unpacked token rows as the tokenizer makes them: a prompt (masked) then a target, right-padded."""
    from ray.data.extensions import ArrowTensorArray

    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), ROW), dtype=np.int64)
    labels = np.full((len(lengths), ROW), IGNORE_INDEX, dtype=np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(4, TINY["vocab_size"], n)
        prompt = n // 2
        labels[row, prompt:n] = ids[row, prompt:n]
    return pa.table({"input_ids": ArrowTensorArray.from_numpy(ids), "labels": ArrowTensorArray.from_numpy(labels),
                     "length": pa.array(lengths, pa.int64()),
                     "source": pa.array(sources or [0] * len(lengths), pa.int64())})


def _columns(table: pa.Table) -> dict[str, torch.Tensor]:
    from ray.data.block import BlockAccessor

    return {k: torch.tensor(v) for k, v in BlockAccessor.for_block(table).to_numpy().items()}


def test_first_fit_places_every_record_once_within_the_row_length():
    lengths = np.random.default_rng(1).integers(1, 40, 500)
    rows = first_fit(lengths, ROW, open_rows=8)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(lengths[row].sum() <= ROW for row in rows)
    assert len(rows) < 0.7 * len(lengths)  # one record per row would take 500
    assert rows == first_fit(lengths, ROW, open_rows=8)  # the same inputs, the same rows
    assert len(first_fit(lengths, ROW, open_rows=64)) <= len(rows)  # a larger buffer packs as well or better


def test_packed_rows_hold_the_records_with_restarted_positions_and_masked_first_labels():
    table = _token_rows([10, 20, 30, 12], sources=[0, 1, 1, 0])
    packed = _columns(pack_rows(table, ROW, pad_id=0, sources=2, open_rows=4))
    unpacked = _columns(table)
    assert packed["length"].sum() == 72 and packed["records"].sum(0).tolist() == [2, 2]
    for row in range(len(packed["length"])):
        starts = (packed["position_ids"][row] == 0).nonzero().flatten().tolist()
        assert all(packed["labels"][row, s] == IGNORE_INDEX for s in starts)
    assert target_token_count(packed["labels"]) == target_token_count(unpacked["labels"])
    one_hot = _columns(unpacked_rows(table, sources=2))["records"]
    assert one_hot.tolist() == [[1, 0], [0, 1], [0, 1], [1, 0]]


def _tiny(architecture: str, attention: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, **(TINY | ARCHITECTURES[architecture]))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention).eval()


@pytest.mark.parametrize("architecture,attention", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                                    ("gemma2", "eager"), ("phi3", "sdpa"), ("gpt_neox", "sdpa")])
def test_each_packed_record_has_the_loss_it_has_alone(architecture, attention):
    """Per record: the packed row's token losses over that record's span == the record's unpacked loss."""
    lengths = [17, 9, 22, 30, 14, 6]
    table = _token_rows(lengths, seed=3)
    packed = _columns(pack_rows(table, ROW, pad_id=0, sources=1, open_rows=4))
    unpacked = _columns(table)
    assert len(packed["length"]) < len(lengths)  # several records do share rows
    model = _tiny(architecture, attention)
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), packed["labels"][:, 1:],
                                     ignore_index=IGNORE_INDEX, reduction="none")
        alone = [summed_token_loss(model, {"input_ids": unpacked["input_ids"][i:i + 1],
                                           "labels": unpacked["labels"][i:i + 1]}) for i in range(len(lengths))]
    members = first_fit(np.array(lengths), ROW, open_rows=4)  # which records each packed row holds, in order
    for row, records in enumerate(members):
        start = 0
        for record in records:  # token_loss[t] is the loss of predicting token t + 1
            packed_loss = token_loss[row, start:start + lengths[record] - 1].sum()
            assert packed_loss.item() == pytest.approx(alone[record].item(), rel=1e-5), (row, record)
            start += lengths[record]


def test_for_flash_attention_packed_rows_are_laid_end_to_end_without_changing_the_loss():
    """FlashAttention reads restarting positions only in a batch of one row (no GPU here: the flattened batch
    is scored with SDPA, which reads them in any shape; equal losses show the flattening is exact)."""
    from types import SimpleNamespace

    from app.train.loss import _as_one_sequence_for_flash

    packed = _columns(pack_rows(_token_rows([17, 9, 22, 30, 14, 6], seed=3), ROW, pad_id=0, sources=1, open_rows=4))
    flash_model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    flat = _as_one_sequence_for_flash(flash_model, packed)
    assert flat["input_ids"].shape == (1, packed["input_ids"].numel())
    assert _as_one_sequence_for_flash(_tiny("llama", "sdpa"), packed) is packed  # other kernels: as it is
    model = _tiny("llama", "sdpa")
    with torch.no_grad():
        assert summed_token_loss(model, flat).item() == pytest.approx(summed_token_loss(model, packed).item(), rel=1e-5)
    assert target_token_count(flat["labels"]) == target_token_count(packed["labels"])

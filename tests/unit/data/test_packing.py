"""Packing: records share a row but train as if alone (positions restart, attention stays inside each)."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from app.config.sections import ModelSection
from app.data.chat import IGNORE_INDEX
from app.data.formatting import tokenize_rows
from app.data.packing import first_fit, pack_rows, unpacked_rows
from app.errors import UserInputError
from app.launch.model_checks import check_packing
from app.model.packing_probe import packing_problem
from app.train.loss import global_target_tokens, scaled_micro_batch_loss, summed_token_loss, target_token_count
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
    config = AutoConfig.for_model(architecture, **(TINY | ARCHITECTURES.get(architecture, {})))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention).eval()


@pytest.mark.parametrize("architecture,attention", [
    ("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gemma2", "eager"), ("phi3", "sdpa"),
    ("gpt_neox", "sdpa"),
    # these take no positions to their mask: the step gives them the 4-D block-diagonal mask the probe found they take
    ("falcon", "sdpa"), ("falcon", "eager"), ("opt", "sdpa"), ("mpt", "eager"), ("xglm", "eager"), ("biogpt", "sdpa")])
def test_each_packed_record_has_the_loss_it_has_alone(architecture, attention):
    """Per record, as the training step computes it (packed: the chunked loss; alone: the plain one): the
    packed row's loss with only that record's labels == the record's loss alone."""
    lengths = [17, 9, 22, 30, 14, 6]
    table = _token_rows(lengths, seed=3)
    packed = _columns(pack_rows(table, ROW, pad_id=0, sources=1, open_rows=4))
    unpacked = _columns(table)
    assert len(packed["length"]) < len(lengths)  # several records do share rows
    model = _tiny(architecture, attention)
    members = first_fit(np.array(lengths), ROW, open_rows=4)  # which records each packed row holds, in order
    with torch.no_grad():
        for row, records in enumerate(members):
            start = 0
            for record in records:
                span = slice(start, start + lengths[record])
                labels = torch.full((1, ROW), IGNORE_INDEX)
                labels[0, span] = packed["labels"][row, span]
                packed_loss = summed_token_loss(model, {"input_ids": packed["input_ids"][row:row + 1], "labels": labels,
                                                        "position_ids": packed["position_ids"][row:row + 1]}, 16)
                alone = summed_token_loss(model, {"input_ids": unpacked["input_ids"][record:record + 1],
                                                  "labels": unpacked["labels"][record:record + 1]})
                assert packed_loss.item() == pytest.approx(alone.item(), rel=1e-5), (row, record)
                start += lengths[record]


def test_a_model_that_cannot_keep_packed_records_apart_is_refused_in_one_line(tmp_path):
    """Bloom takes ALiBi from a 2-D attention mask: restarting positions do not reach its mask, and a 4-D
    mask breaks it. The driver stops before any worker starts, naming data.packing."""
    AutoConfig.for_model("bloom", **TINY).save_pretrained(tmp_path)
    with pytest.raises(UserInputError) as refused:
        check_packing(ModelSection(path=str(tmp_path)))
    message = str(refused.value)
    assert "\n" not in message and message.endswith("; set data.packing=false")
    assert message.startswith("data.packing: bloom does not isolate packed records (a record's loss differs by ")
    AutoConfig.for_model("falcon", **TINY).save_pretrained(tmp_path)
    check_packing(ModelSection(path=str(tmp_path)))  # Falcon takes the block mask: packing stays on
    falcon_on_flash = ModelSection(path=str(tmp_path), attn_implementation="flash_attention_2")
    with pytest.raises(UserInputError, match="only with a 4-D attention mask, which model.attn_implementation"):
        check_packing(falcon_on_flash)


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


def _identical_records(ids: np.ndarray, labels: np.ndarray, count: int, row_len: int, pad_id: int) -> pa.Table:
    """`count` copies of one tokenized record as unpacked token rows (right-padded to row_len)."""
    from ray.data.extensions import ArrowTensorArray

    padded_ids = np.full((count, row_len), pad_id, dtype=np.int64)
    padded_labels = np.full((count, row_len), IGNORE_INDEX, dtype=np.int64)
    padded_ids[:, :len(ids)], padded_labels[:, :len(ids)] = ids, labels
    return pa.table({"input_ids": ArrowTensorArray.from_numpy(padded_ids),
                     "labels": ArrowTensorArray.from_numpy(padded_labels),
                     "length": pa.array([len(ids)] * count, pa.int64()), "source": pa.array([0] * count, pa.int64())})


def _step_loss(model, batch: dict) -> float:
    """The step's train_loss for one micro-batch on one worker: chunked token losses / the target-token count."""
    return scaled_micro_batch_loss(model, batch, global_target_tokens([batch]), 1, chunk_tokens=1024)[0].item()


@pytest.mark.parametrize("architecture", ["embedded", "falcon", "opt", "bloom"])
def test_the_step_loss_of_identical_records_is_the_same_packed_or_the_job_refuses_packing(architecture, embedded):
    """fp32, the embedded model and task or a tiny random model: 8 copies of one record, packed (several to a
    row) or one per row, give the same step-1 loss; or the driver refuses data.packing in one line."""
    row_len = 128
    if architecture == "embedded":
        model = AutoModelForCausalLM.from_pretrained(embedded["model"], dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(embedded["model"])
        record = json.loads(embedded["train"].read_text().splitlines()[0])
        tokens = tokenize_rows([record], tokenizer, "auto", row_len)
        n, pad_id = tokens["length"][0], tokenizer.pad_token_id
        table = _identical_records(tokens["input_ids"][0, :n], tokens["labels"][0, :n], 8, row_len, pad_id)
    else:
        model = _tiny(architecture, "sdpa" if architecture != "bloom" else "eager")
        ids = np.random.default_rng(0).integers(4, TINY["vocab_size"], 30)
        labels = np.where(np.arange(30) < 12, IGNORE_INDEX, ids)  # a prompt, then the target
        table = _identical_records(ids, labels, 8, row_len, pad_id=0)
    problem = packing_problem(model.config, model.config._attn_implementation)
    if architecture == "bloom":
        assert problem and "\n" not in problem and problem.startswith("data.packing: bloom does not isolate")
        return
    assert problem is None
    packed = _columns(pack_rows(table, row_len, pad_id=0, sources=1, open_rows=4))
    assert len(packed["input_ids"]) < 8  # records do share rows
    with torch.no_grad():
        assert _step_loss(model, packed) == pytest.approx(_step_loss(model, _columns(table)), rel=1e-6)

"""The Ray Data pipeline on a real local Ray: every source kind gives the same token rows; each pass over
the data is shuffled globally, split the same way for the same seed, resumable exactly, and draws a
mixture's sources in their proportions."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from app.data import build_pass, build_train_data, start_pass_coordinator
from app.datasource import check_source, resolve_source
from app.embedded import number_in_words
from app.formatting import IGNORE_INDEX
from app.stream import ShardStream
from tests.helpers import chat, make_config, write_jsonl


def _rows(ds) -> list[tuple]:
    return sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in ds.take_all())


@pytest.fixture(scope="module")
def tokenizer(embedded):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded["model"])


@pytest.fixture(scope="module")
def records(embedded):
    return [json.loads(line) for line in embedded["train"].read_text().splitlines()[:40]]


def _numbered(count: int, start: int = 0) -> list[dict]:
    """Records that differ: row identity survives tokenization."""
    return [chat(f"Write {n} in words.", number_in_words(n)) for n in range(start, start + count)]


def _train_data(cfg, *paths, eval_fraction=None, tokenizer=None):
    """Small test data: tokenized in the driver, unless a test sends it through the tokenizer actors."""
    from app.model import load_tokenizer

    sources = [resolve_source(str(p)) for p in paths]
    return build_train_data(sources, [check_source(s, "auto") for s in sources], tokenizer or load_tokenizer(cfg.model),
                            cfg.model, cfg.data, cfg.train.seed, eval_fraction)


def test_jsonl_json_array_parquet_and_save_to_disk_give_identical_rows(ray_cluster, embedded, records, tmp_path):
    import datasets

    cfg = make_config(tmp_path, embedded)
    write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "alpaca.json").write_text(json.dumps(records, indent=1))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "b.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(tmp_path / "hf")
    results = [_rows(_train_data(cfg, tmp_path / name)[0].sources[0])
               for name in ("a.jsonl", "alpaca.json", "b.parquet", "hf")]
    by_actors = make_config(tmp_path, embedded, "data.tokenize_in_driver_below=0")  # what large data takes
    results.append(_rows(_train_data(by_actors, tmp_path / "b.parquet")[0].sources[0]))
    assert len(results[0]) == 40 and all(r == results[0] for r in results)
    ids, labels = map(np.array, results[0][0])
    assert ids.shape == (cfg.data.max_seq_len,) and (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()


def test_without_eval_data_a_seeded_fraction_is_held_out(ray_cluster, embedded, records, tmp_path):
    cfg = make_config(tmp_path, embedded, "data.eval_fraction=0.25")
    write_jsonl(tmp_path / "a.jsonl", records)
    train, held_out = _train_data(cfg, tmp_path / "a.jsonl", eval_fraction=0.25)
    assert (train.sources[0].count(), held_out[0].count()) == (30, 10)
    again = _train_data(cfg, tmp_path / "a.jsonl", eval_fraction=0.25)[1][0]
    assert sorted(map(json.dumps, again.take_all())) == sorted(map(json.dumps, held_out[0].take_all()))


def test_records_truncated_to_no_target_are_dropped_and_counted(ray_cluster, embedded, tmp_path):
    cfg = make_config(tmp_path, embedded)  # data.max_seq_len=32
    long_prompt = chat("Please write the number " + "one " * 40 + "in words.", "one")
    write_jsonl(tmp_path / "a.jsonl", _numbered(10) + [long_prompt] * 3)
    train, _ = _train_data(cfg, tmp_path / "a.jsonl")
    assert train.dropped_rows == 3 and train.sources[0].count() == 10 and train.plan.rows == (10,)


def _answers(rows, tokenizer) -> list[str]:
    return [tokenizer.decode([t for t, lab in zip(r["input_ids"], r["labels"]) if lab != IGNORE_INDEX],
                             skip_special_tokens=True).strip() for r in rows]


def test_a_sorted_file_gives_mixed_batches_and_every_pass_its_own_order(ray_cluster, embedded, tokenizer, tmp_path):
    cfg = make_config(tmp_path, embedded)
    write_jsonl(tmp_path / "sorted.jsonl", [chat("Say it.", "first")] * 64 + [chat("Say it.", "second")] * 64)
    train, _ = _train_data(cfg, tmp_path / "sorted.jsonl")
    pass0, pass1 = (build_pass(train, epoch, 2, shuffle=True) for epoch in (0, 1))
    first_batch = _answers(pass0[0].take(16), tokenizer)
    assert {"first", "second"} <= set(first_batch)  # file order would give 16 x "first"
    assert [s.count() for s in pass0] == [64, 64]
    order = lambda shards: [list(r["input_ids"]) for s in shards for r in s.take_all()]  # noqa: E731
    assert order(pass0) == order(build_pass(train, 0, 2, shuffle=True))  # the same seed: the same shards
    assert _answers(pass0[0].take_all(), tokenizer) != _answers(pass1[0].take_all(), tokenizer)
    in_file_order = _answers(build_pass(train, 0, 2, shuffle=False)[0].take_all(), tokenizer)
    assert in_file_order == ["first"] * 64  # data.shuffle=false: file order


def _consume(coordinator, rank: int, batches: int, skip_rows: int, tokenizer) -> list[str]:
    def one_pass(epoch):
        return ray.get(coordinator.shard.remote(epoch, rank)).iter_torch_batches(batch_size=4)
    stream = ShardStream(one_pass, torch.device("cpu"), epoch=0, skip_rows=skip_rows)
    seen = []
    for _ in range(batches):
        batch = next(stream)
        seen += _answers([{"input_ids": i, "labels": lab} for i, lab in zip(batch["input_ids"].tolist(),
                                                                         batch["labels"].tolist())], tokenizer)
    return seen


def test_a_resumed_pass_trains_every_row_exactly_once(ray_cluster, embedded, tokenizer, tmp_path):
    """Two ranks train 3 batches of 4, a checkpoint records the position, the job dies; a new job (a new
    coordinator, the same seed and worker count) skips what was trained and finishes the pass."""
    cfg = make_config(tmp_path, embedded)
    write_jsonl(tmp_path / "numbers.jsonl", _numbered(48))
    train, _ = _train_data(cfg, tmp_path / "numbers.jsonl")
    before, after = [], []
    first_job = start_pass_coordinator(train, 2, shuffle=True)
    for rank in (0, 1):
        before += _consume(first_job, rank, batches=3, skip_rows=0, tokenizer=tokenizer)
    ray.kill(first_job)
    second_job = start_pass_coordinator(_train_data(cfg, tmp_path / "numbers.jsonl")[0], 2, shuffle=True)
    for rank in (0, 1):
        after += _consume(second_job, rank, batches=3, skip_rows=3 * 4, tokenizer=tokenizer)
    everything = sorted(number_in_words(n) for n in range(48))
    assert len(before) == len(after) == 24
    assert sorted(before + after) == everything  # each row once: none twice, none missed


def test_a_mixture_draws_each_source_in_its_share(ray_cluster, embedded, tmp_path):
    cfg = make_config(tmp_path, embedded, "data.mixture_weights=[0.5, 0.5]",
                      f"data.train_path=[{tmp_path / 'big.jsonl'}, {tmp_path / 'small.jsonl'}]")
    write_jsonl(tmp_path / "big.jsonl", _numbered(40))
    write_jsonl(tmp_path / "small.jsonl", _numbered(10, start=500))
    train, _ = _train_data(cfg, *cfg.data.train_paths)
    assert train.plan.names == ("big", "small") and train.plan.rows_per_pass() == [25, 25]
    shards = build_pass(train, 0, 2, shuffle=True)
    sources = [r["source"] for s in shards for r in s.take_all()]
    assert (sources.count(0), sources.count(1)) == (25, 25)  # the small source repeated to fill its half

"""The Ray Data pipeline on a real local Ray: every source kind yields the same token rows."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data import build_datasets
from app.datasource import resolve_source
from app.formatting import IGNORE_INDEX
from tests.helpers import make_config


def _rows(ds) -> list[tuple]:
    return sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in ds.take_all())


@pytest.fixture(scope="module")
def tokenizer(embedded):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded["model"])


@pytest.fixture(scope="module")
def records(embedded):
    return [json.loads(line) for line in embedded["train"].read_text().splitlines()[:40]]


def test_jsonl_parquet_and_save_to_disk_give_identical_rows(ray_cluster, embedded, records, tokenizer, tmp_path):
    import datasets

    cfg = make_config(tmp_path, embedded)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "b.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(tmp_path / "hf")
    evals = resolve_source(str(embedded["eval"]))
    results = [_rows(build_datasets(resolve_source(str(tmp_path / name)), evals, tokenizer, cfg.model, cfg.data, 0)[0])
               for name in ("a.jsonl", "b.parquet", "hf")]
    assert len(results[0]) == 40 and results[0] == results[1] == results[2]
    ids, labels = map(np.array, results[0][0])
    assert ids.shape == (cfg.data.max_seq_len,) and (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()


def test_without_eval_data_a_seeded_fraction_is_held_out(ray_cluster, embedded, records, tokenizer, tmp_path):
    cfg = make_config(tmp_path, embedded, "data.eval_fraction=0.25")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train, eval_ = build_datasets(resolve_source(str(tmp_path / "a.jsonl")), None, tokenizer, cfg.model, cfg.data, 0)
    train_rows, eval_rows = _rows(train), _rows(eval_)
    assert (len(train_rows), len(eval_rows)) == (30, 10)
    again = _rows(build_datasets(resolve_source(str(tmp_path / "a.jsonl")), None, tokenizer, cfg.model, cfg.data, 0)[1])
    assert again == eval_rows

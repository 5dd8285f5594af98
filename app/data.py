"""The Ray Data pipeline: read -> format + tokenize (map_batches) -> fixed-length token rows.

The training set streams to the workers (Ray Train splits it with `streaming_split`); the eval set is
small, capped at `data.max_eval_rows`, materialized once and read whole by every worker.
"""

from __future__ import annotations

import ray.data

from app.config import DataSection, ModelSection
from app.datasource import DataSource, load_hf_disk
from app.formatting import cached_tokenizer, tokenize_rows


def read_records(source: DataSource, data: DataSection) -> ray.data.Dataset:
    if source.kind == "jsonl":
        return ray.data.read_json(list(source.files) or source.location, lines=True)
    if source.kind == "parquet":
        return ray.data.read_parquet(list(source.files) or source.location)
    if source.kind == "hf_disk":
        return ray.data.from_huggingface(load_hf_disk(source.location, data.split))
    import datasets

    return ray.data.from_huggingface(datasets.load_dataset(source.location, split=data.split))


def _tokenize_batch(batch, model: ModelSection, data: DataSection) -> dict:
    tokenizer = cached_tokenizer(model.path, model.revision, model.trust_remote_code)
    return tokenize_rows(batch.to_pylist(), tokenizer, data.format, data.max_seq_len)


def tokenized(ds: ray.data.Dataset, model: ModelSection, data: DataSection) -> ray.data.Dataset:
    return ds.map_batches(_tokenize_batch, fn_kwargs={"model": model, "data": data},
                          batch_format="pyarrow", batch_size=256)


def build_datasets(train: DataSource, eval_: DataSource | None, model: ModelSection, data: DataSection,
                   seed: int) -> tuple[ray.data.Dataset, ray.data.Dataset]:
    """(train, eval) datasets of token rows; without an eval source, a seeded split of the train set."""
    train_ds = read_records(train, data)
    if eval_ is not None:
        eval_ds = read_records(eval_, data)
    else:
        train_ds, eval_ds = train_ds.train_test_split(test_size=data.eval_fraction, shuffle=True, seed=seed)
    eval_ds = tokenized(eval_ds.limit(data.max_eval_rows), model, data).materialize()
    return tokenized(train_ds, model, data), eval_ds

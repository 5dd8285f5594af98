"""The Ray Data pipeline: read -> format + tokenize (map_batches) -> fixed-length token rows.

The training set streams to the workers (Ray Train splits it with `streaming_split`). By default it is
tokenized once, before training, and its token rows kept in Ray's object store (which spills to
disk): every later pass only reads blocks. Re-running the read + tokenize pipeline on each pass
(`data.cache_tokenized: false`) is for data the object store cannot hold; each pass then waits for
the tokenizing actors to start. The eval set is small, capped at `data.max_eval_rows`, held in the
object store and read whole by every worker.
"""

from __future__ import annotations

import ray.data

from app.config import DataSection, ModelSection
from app.datasource import DataSource, load_hf_disk
from app.formatting import tokenize_rows
from app.model import load_tokenizer


def read_records(source: DataSource, data: DataSection) -> ray.data.Dataset:
    if source.kind == "jsonl":
        return ray.data.read_json(list(source.files) or source.location, lines=True)
    if source.kind == "parquet":
        return ray.data.read_parquet(list(source.files) or source.location)
    if source.kind == "hf_disk":
        return ray.data.from_huggingface(load_hf_disk(source.location, data.split))
    import datasets

    return ray.data.from_huggingface(datasets.load_dataset(source.location, split=data.split))


class TokenizeRows:
    """The map_batches UDF, run by a pool of actors that each load the tokenizer once.

    Actors rather than tasks: when a run fails and Ray cancels the pipeline, an actor's process goes
    away with it, where a task's pooled process can be left with a half-finished `import torch` that
    breaks every later task it runs (seen here after a worker was killed mid-run).
    """

    def __init__(self, model: ModelSection, data: DataSection):
        self.tokenizer = load_tokenizer(model)
        self.data = data

    def __call__(self, batch) -> dict:
        return tokenize_rows(batch.to_pylist(), self.tokenizer, self.data.format, self.data.max_seq_len)


def tokenized(ds: ray.data.Dataset, model: ModelSection, data: DataSection) -> ray.data.Dataset:
    return ds.map_batches(TokenizeRows, fn_constructor_kwargs={"model": model, "data": data},
                          compute=ray.data.ActorPoolStrategy(min_size=1, max_size=data.tokenizer_actors),
                          batch_format="pyarrow", batch_size=256)


def build_datasets(train: DataSource, eval_: DataSource | None, tokenizer, model: ModelSection,
                   data: DataSection, seed: int) -> tuple[ray.data.Dataset, ray.data.Dataset]:
    """(train, eval) datasets of token rows; without an eval source, a seeded split of the train set.

    The eval set (at most `data.max_eval_rows`) is tokenized here in the driver, which already holds
    the tokenizer: starting a tokenizing actor for a few hundred rows would cost more than the work.
    """
    train_ds = read_records(train, data)
    if eval_ is not None:
        eval_ds = read_records(eval_, data)
    else:
        train_ds, eval_ds = train_ds.train_test_split(test_size=data.eval_fraction, shuffle=True, seed=seed)
    records = [r for b in eval_ds.limit(data.max_eval_rows).iter_batches(batch_format="pyarrow") for r in b.to_pylist()]
    rows = tokenize_rows(records, tokenizer, data.format, data.max_seq_len)
    eval_rows = ray.data.from_items([{"input_ids": ids, "labels": labels}
                                     for ids, labels in zip(rows["input_ids"], rows["labels"])])
    train_rows = tokenized(train_ds, model, data)
    return (train_rows.materialize() if data.cache_tokenized else train_rows), eval_rows

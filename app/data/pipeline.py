"""The Ray Data pipeline: read -> format + tokenize (an actor pool, or the driver for small data) ->
fixed-length token rows, once per source, before any worker starts.

Each train source is tokenized once and its rows kept in Ray's object store (which spills to disk).
Rows that no longer hold a target token after truncation are dropped there and counted; the passes over
them are built by the pass coordinator (app/data/coordinator.py). The eval set is small (at most
`data.max_eval_rows`), tokenized in the driver, held in the object store and read whole by every worker.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.data.expressions import col

from app.config.sections import DataSection, ModelSection
from app.data.chat import pad_id
from app.data.formatting import tokenize_rows
from app.data.passes import PassPlan, source_names
from app.data.sources import DataSource, load_hf_disk, read_json_array
from app.errors import UserInputError
from app.model.base import load_tokenizer


def read_records(source: DataSource, data: DataSection) -> ray.data.Dataset:
    if source.kind == "jsonl":
        return ray.data.read_json(list(source.files) or source.location, lines=True)
    if source.kind == "json_array":
        return ray.data.from_items(read_json_array(source.location, data.format))
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

    def __init__(self, model: ModelSection, data: DataSection, source: int):
        self.tokenizer = load_tokenizer(model, data.chat_template)
        self.data, self.source = data, source

    def __call__(self, batch) -> dict:
        rows = tokenize_rows(batch.to_pylist(), self.tokenizer, self.data.format, self.data.max_seq_len,
                             self.data.long_records)
        return rows | {"source": np.full(len(rows["targets"]), self.source, dtype=np.int64)}


def tokenized(ds: ray.data.Dataset, model: ModelSection, data: DataSection, source: int = 0) -> ray.data.Dataset:
    return ds.map_batches(TokenizeRows, fn_constructor_kwargs={"model": model, "data": data, "source": source},
                          compute=ray.data.ActorPoolStrategy(min_size=1, max_size=data.tokenizer_actors),
                          batch_format="pyarrow", batch_size=256)


@dataclass
class TrainData:
    sources: list[ray.data.MaterializedDataset]  # token rows of each source, rows without targets dropped
    plan: PassPlan
    dropped_rows: int  # rows whose every target token truncation cut off
    pad_id: int  # the tokenizer's padding token
    malformed_rows: int = 0  # records without the fields their format needs (remote data past the checked sample)
    truncated_tokens: int = 0  # preference pairs and prompts: tokens cut to fit data.max_seq_len


def tokenized_in_driver(ds: ray.data.Dataset, tokenizer, data: DataSection, source: int) -> ray.data.Dataset:
    """The same rows as `tokenized`, made here: for small data, cheaper than starting tokenizer actors."""
    records = [r for b in ds.iter_batches(batch_format="pyarrow", batch_size=4096) for r in b.to_pylist()]
    rows = tokenize_rows(records, tokenizer, data.format, data.max_seq_len, data.long_records)
    return rows_dataset(rows | {"source": np.full(len(rows["targets"]), source, dtype=np.int64)})


def rows_dataset(rows: dict[str, np.ndarray], block_rows: int = 4096) -> ray.data.Dataset:
    """Token rows as a Dataset of tensor columns (what map_batches makes of numpy arrays), in blocks of
    `block_rows`: batches then reach torch without a per-row conversion."""
    from ray.data.extensions import ArrowTensorArray

    def column(values: np.ndarray):
        return ArrowTensorArray.from_numpy(values) if values.ndim > 1 else pa.array(values)

    count = len(next(iter(rows.values())))
    return ray.data.from_arrow([pa.table({k: column(v[i:i + block_rows]) for k, v in rows.items()})
                                for i in range(0, max(count, 1), block_rows)])


def is_held_out(record: dict, fraction: float, seed: int) -> bool:
    """Whether a record belongs to the eval split: decided by a hash of its content and the seed, so it is
    the same on any cluster, in any block layout, in a resumed job (about `fraction` of the records)."""
    digest = hashlib.sha256(f"{seed}:{json.dumps(record, sort_keys=True, default=str)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def in_split(record: dict, fraction: float, seed: int, held: bool) -> bool:
    return is_held_out(record, fraction, seed) == held


def build_train_data(sources: list[DataSource], records_hint: list[int], tokenizer, model: ModelSection,
                     data: DataSection, seed: int, eval_fraction: float | None,
                     world_size: int = 1) -> tuple[TrainData, list]:
    """Tokenize every source once; with `eval_fraction`, first hold that share of each out (returned raw).

    `records_hint`: each source's record count as the driver's check found it (-1: unknown, remote).
    """
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # row i is the same row in every job
    token_rows, held_out, dropped, malformed, truncated = [], [], 0, 0, 0
    for i, (source, records_count) in enumerate(zip(sources, records_hint)):
        records = read_records(source, data)
        if eval_fraction is not None:
            split = functools.partial(in_split, fraction=eval_fraction, seed=seed)
            held_out.append(records.filter(functools.partial(split, held=True)))
            records = records.filter(functools.partial(split, held=False))
        if 0 <= records_count < data.tokenize_in_driver_below:
            rows = tokenized_in_driver(records, tokenizer, data, i).materialize()
        else:
            rows = tokenized(records, model, data, i).materialize()
        if "truncated" in rows.columns():  # preference pairs and prompts: tokens cut to fit data.max_seq_len
            truncated += rows.sum("truncated") or 0  # the dropped rows' cuts too
        bookkeeping = [c for c in ("targets", "truncated") if c in rows.columns()]
        trainable = rows.filter(expr=col("targets") > 0).drop_columns(bookkeeping).materialize()
        bad = rows.filter(expr=col("targets") < 0).count()
        malformed += bad
        dropped += rows.count() - trainable.count() - bad
        token_rows.append(trainable)
    plan = PassPlan(source_names([s.location for s in sources]), tuple(ds.count() for ds in token_rows),
                    tuple(data.mixture_weights) if data.mixture_weights else None, seed)
    for name, rows in zip(plan.names, plan.rows):
        if rows == 0:
            raise UserInputError(f"data.train_path: {name} has no record left to train on (every one lacks its "
                                 f"fields or a target token within data.max_seq_len={data.max_seq_len})")
    if sum(plan.rows_per_pass()) < world_size:
        raise UserInputError(f"data.train_path: {sum(plan.rows_per_pass())} training records for "
                             f"scaling.num_workers={world_size}; every worker needs at least one")
    return TrainData(token_rows, plan, dropped, pad_id(tokenizer), malformed, int(truncated)), held_out


def build_eval_rows(sources: list[ray.data.Dataset], tokenizer, data: DataSection) -> tuple[dict[str, np.ndarray], int]:
    """(eval token rows, how many were dropped for having no target): tokenized here in the driver, which
    holds the tokenizer already; starting a tokenizing actor for a few hundred rows costs more."""
    eval_ds = sources[0] if len(sources) == 1 else sources[0].union(*sources[1:])
    records = [r for b in eval_ds.limit(data.max_eval_rows).iter_batches(batch_format="pyarrow") for r in b.to_pylist()]
    rows = tokenize_rows(records, tokenizer, data.format, data.max_seq_len, data.long_records)
    keep = rows["targets"] > 0
    if not keep.any():
        where = ("data.eval_path" if data.eval_path else
                 f"data.eval_fraction={data.eval_fraction} of data.train_path (the held-out share came out empty)")
        raise UserInputError(f"{where}: no eval record left with a target token within data.max_seq_len="
                             f"{data.max_seq_len} ({len(records)} read); give more or longer-allowed eval data")
    columns = {k: v[keep] for k, v in rows.items() if k not in ("targets", "truncated", "length")}
    return columns, int((~keep).sum())

"""The Ray Data pipeline: read -> format + tokenize (an actor pool, or the driver for small data) ->
fixed-length token rows, and the passes over them that the training workers read.

Each train source is tokenized once and its rows kept in Ray's object store (which spills to disk).
Rows that no longer hold a target token after truncation are dropped there and counted. A
`PassCoordinator` actor then builds every pass the same way for all ranks (app/data/passes.py): each
source's share of rows, shuffled together with the pass's seed, dealt to the ranks in turn. The same seed,
pass and worker count always give the same shards, so a restarted or resumed run sees the rest of an
interrupted pass exactly once. The eval set is small (at most `data.max_eval_rows`), tokenized in the
driver, held in the object store and read whole by every worker.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data
from ray.data.expressions import col

from app.config.schema import DataSection, ModelSection
from app.data.formatting import tokenize_rows
from app.data.packing import pack_rows, unpacked_rows
from app.data.passes import PassPlan, deal, pass_records, source_names, take_rows
from app.data.sources import DataSource, load_hf_disk, read_json_array
from app.errors import UserInputError
from app.model.build import load_tokenizer


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
    token_rows, held_out, dropped, malformed = [], [], 0, 0
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
        trainable = rows.filter(expr=col("targets") > 0).drop_columns(["targets"]).materialize()
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
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TrainData(token_rows, plan, dropped, pad_id, malformed), held_out


def build_eval_rows(sources: list[ray.data.Dataset], tokenizer, data: DataSection) -> tuple[ray.data.Dataset, int]:
    """(eval token rows, how many were dropped for having no target): tokenized here in the driver, which
    holds the tokenizer already; starting a tokenizing actor for a few hundred rows costs more."""
    eval_ds = sources[0] if len(sources) == 1 else sources[0].union(*sources[1:])
    records = [r for b in eval_ds.limit(data.max_eval_rows).iter_batches(batch_format="pyarrow") for r in b.to_pylist()]
    rows = tokenize_rows(records, tokenizer, data.format, data.max_seq_len, data.long_records)
    keep = rows["targets"] > 0
    return rows_dataset({"input_ids": rows["input_ids"][keep], "labels": rows["labels"][keep]}), int((~keep).sum())


def shard_batches(table: pa.Table, batch_size: int):
    """A shard's rows as micro-batches of numpy arrays (the last one may be smaller; every rank's shard has
    the same number of rows, so every rank gets the same number of batches)."""
    from ray.data.block import BlockAccessor

    for start in range(0, table.num_rows, batch_size):
        yield BlockAccessor.for_block(table.slice(start, batch_size)).to_numpy()


@ray.remote(num_cpus=0)
class PassCoordinator:
    """Builds each pass once for all ranks (and the next one ahead), keeps the last two.

    It holds the token rows as zero-copy views of their blocks in Ray's object store, and builds a pass in
    its own process (an index permutation, packing, a gather per rank, put back in the object store): no
    Ray task runs during training, so a cluster whose CPUs the training workers hold never starves it.
    Created by the driver, it outlives restarted worker groups, which get the same shards again.
    """

    def __init__(self, blocks: list[list[ray.ObjectRef]], plan: PassPlan, pad_id: int, world_size: int,
                 data: DataSection):
        self.plan, self.pad_id, self.world_size, self.data = plan, pad_id, world_size, data
        self.tables = [pa.concat_tables(ray.get(refs)) for refs in blocks]
        self._lock = threading.Lock()
        self._ready: dict[int, threading.Event] = {}
        self._built: dict[int, list | BaseException] = {}
        self._start(0)

    def _start(self, epoch: int) -> threading.Event:
        with self._lock:
            if epoch not in self._ready:
                self._ready[epoch] = threading.Event()
                threading.Thread(target=self._build, args=(epoch,), daemon=True).start()
            return self._ready[epoch]

    def _build(self, epoch: int) -> None:
        try:
            rows = take_rows(self.tables, pass_records(self.plan, epoch, self.data.shuffle))
            sources = len(self.plan.rows)
            rows = (pack_rows(rows, self.data.max_seq_len, self.pad_id, sources, self.data.packing_open_rows)
                    if self.data.packing else unpacked_rows(rows, sources))
            if rows.num_rows < self.world_size:
                raise UserInputError(f"data.packing: the training records fill {rows.num_rows} rows of "
                                     f"data.max_seq_len={self.data.max_seq_len}, fewer than scaling.num_workers="
                                     f"{self.world_size}; add data, use fewer workers or set data.packing=false")
            built = [ray.put(rows.take(pa.array(shard))) for shard in deal(rows.num_rows, self.world_size)]
        except BaseException as e:  # handed to the rank that asks for this pass
            built = e
        with self._lock:
            self._built[epoch] = built
            self._ready[epoch].set()

    def shard(self, epoch: int, rank: int) -> list:
        """[a reference to this rank's rows of pass `epoch`] (in a list: Ray would resolve a bare one)."""
        self._start(epoch).wait()
        built = self._built[epoch]
        if isinstance(built, BaseException):
            raise built
        self._start(epoch + 1)
        with self._lock:  # a restarted worker group asking for an older pass again gets it rebuilt
            for old in [e for e in self._built if e < epoch - 1]:
                del self._built[old], self._ready[old]
        return [built[rank]]

    def first_pass_figures(self) -> dict[str, float]:
        """Rows each rank trains per pass and how full they are, from pass 0; raises what building it raised
        (the driver asks before any worker starts)."""
        [ref] = self.shard(0, 0)
        rows = ray.get(ref)
        fill = pc.sum(rows.column("length")).as_py() / max(rows.num_rows * self.data.max_seq_len, 1)
        return {"data_rows_per_worker_per_pass": rows.num_rows, "data_row_fill": fill}


def start_pass_coordinator(train: TrainData, world_size: int, data: DataSection):
    """On the driver's node: the job ends with it anyway, and so does a job whose coordinator dies
    (`--resume` then continues exactly). Not restartable: Ray logs an error line for any restartable actor
    given object references (ray issue 53727), and its token rows are references the driver owns."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return PassCoordinator.options(max_concurrency=world_size + 2, scheduling_strategy=here).remote(
        [rows.to_arrow_refs() for rows in train.sources], train.plan, train.pad_id, world_size, data)


def start_passes(train: TrainData, world_size: int, data: DataSection):
    """(the pass coordinator, figures of its first pass); a pass that cannot be built fails here, in the
    driver, with its one-line reason."""
    coordinator = start_pass_coordinator(train, world_size, data)
    try:
        return coordinator, ray.get(coordinator.first_pass_figures.remote())
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserInputError):
            raise e.cause from None
        raise

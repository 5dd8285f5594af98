"""The pass coordinator: one actor that builds every pass over the training rows for all ranks.

Each pass is built the same way for every rank (app/data/passes.py): each source's share of rows,
shuffled together with the pass's seed, packed (app/data/packing.py) or one record per row, and dealt to
the ranks in turn. The same seed, pass and worker count always give the same rows to each rank, so a restarted or
resumed run sees the rest of an interrupted pass exactly once. `batches_of` is the worker's side: its
rows as micro-batches.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import ray

from app.data.packing import pack_rows, unpacked_rows
from app.data.passes import PassPlan, deal, pass_records, take_rows
from app.errors import UserInputError

if TYPE_CHECKING:  # the actor's process imports this module: it stays free of torch, pydantic and the pipeline
    from app.config.sections import DataSection
    from app.data.pipeline import TrainData


class DataNotBuilt(UserInputError):
    """The driver could not build the data; the message is its one-line reason, which the driver reports."""


def batches_of(table: pa.Table, batch_size: int):
    """A rank's rows as micro-batches of numpy arrays (the last one may be smaller; every rank's part has
    the same number of rows, so every rank gets the same number of batches)."""
    from ray.data.block import BlockAccessor

    for start in range(0, table.num_rows, batch_size):
        yield BlockAccessor.for_block(table.slice(start, batch_size)).to_numpy()


class PassCache:
    """Each pass built once for all ranks, in a thread, and the next one ahead. `build(pass_index)` returns the
    pass's rows for each rank. A pass is dropped once every rank has asked for a later one: ranks are not
    in step between collectives (on tiny data a pass is a micro-batch, and a rank takes a step's micro-batches
    before any collective), so one may still ask for a pass that another has left behind."""

    def __init__(self, build: Callable[[int], list], world_size: int, first_pass: int | None = 0):
        """`first_pass`: built at once, ahead of the first ask (None: nothing until asked)."""
        self._build_pass = build
        self._lock = threading.Lock()
        self._ready: dict[int, threading.Event] = {}
        self._built: dict[int, list | BaseException] = {}
        self._asked = [0] * world_size  # the pass each rank asked for last
        if first_pass is not None:
            with self._lock:
                self._start(first_pass)

    def _start(self, pass_index: int) -> threading.Event:
        """The event set once pass `pass_index` is built, starting its build if none has; under the lock."""
        if pass_index not in self._ready:
            self._ready[pass_index] = threading.Event()
            threading.Thread(target=self._build, args=(pass_index,), daemon=True).start()
        return self._ready[pass_index]

    def _build(self, pass_index: int) -> None:
        try:
            built = self._build_pass(pass_index)
        except BaseException as e:  # handed to the rank that asks for this pass
            built = e
        with self._lock:
            self._built[pass_index] = built
            self._ready[pass_index].set()

    def rank_rows(self, pass_index: int, rank: int):
        """Rank `rank`'s rows of pass `pass_index`; raises what building the pass raised. A restarted worker group
        asking for a pass already dropped gets it rebuilt."""
        with self._lock:
            self._asked[rank] = pass_index
            ready = self._start(pass_index)
        ready.wait()
        with self._lock:
            built = self._built[pass_index]
            if isinstance(built, BaseException):
                raise built
            self._start(pass_index + 1)
            for old in [e for e in self._built if e < min(self._asked)]:
                del self._built[old], self._ready[old]
        return built[rank]


@ray.remote(num_cpus=0)
class PassCoordinator:
    """Builds each pass once for all ranks (app.data.coordinator.PassCache), ahead of the ranks.

    It holds the token rows as zero-copy views of their blocks in Ray's object store, and builds a pass in
    its own process (an index permutation, packing, a gather per rank, put back in the object store): no
    Ray task runs during training, so a cluster whose CPUs the training workers hold never starves it.
    Created by the driver, it outlives restarted worker groups, which get the same rows again. It is
    created empty, so that the worker group can start while the driver builds the data: ranks that ask
    before the driver has loaded the rows (or told it why it could not) wait for it.
    """

    def __init__(self, world_size: int, data: DataSection):
        self.world_size, self.data = world_size, data
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        self._failure: str | None = None
        self._passes: dict[int, PassCache] = {}

    def load(self, blocks: list[list[ray.ObjectRef]], plan: PassPlan, pad_id: int,
             eval_rows: list[ray.ObjectRef]) -> None:
        """The training rows (each source's blocks), how passes draw from them, and the eval rows (a reference
        in a list: read whole by every rank)."""
        self.plan, self.pad_id, self._eval_rows = plan, pad_id, eval_rows
        self.tables = [pa.concat_tables(ray.get(refs)) for refs in blocks]
        with self._lock:
            self._passes[self.world_size] = self._cache(self.world_size, first_pass=0)
        self._loaded.set()

    def fail(self, reason: str) -> None:
        """The driver could not build the data: every rank that waits for it, or asks later, gets `reason`."""
        self._failure = reason
        self._loaded.set()

    def _wait_for_data(self) -> None:
        self._loaded.wait()
        if self._failure is not None:
            raise DataNotBuilt(self._failure)

    def eval_rows(self) -> list[ray.ObjectRef]:
        """[a reference to the eval rows] (column -> array)."""
        self._wait_for_data()
        return self._eval_rows

    def _cache(self, world_size: int, first_pass: int | None) -> PassCache:
        return PassCache(functools.partial(self._build, world_size=world_size), world_size, first_pass)

    def _build(self, pass_index: int, world_size: int) -> list[ray.ObjectRef]:
        rows = take_rows(self.tables, pass_records(self.plan, pass_index, self.data.shuffle))
        sources = len(self.plan.rows)
        rows = (pack_rows(rows, self.data.max_seq_len, self.pad_id, sources, self.data.packing_open_rows)
                if self.data.packing else unpacked_rows(rows, sources))
        if rows.num_rows < world_size:
            raise UserInputError(f"data.packing: the training records fill {rows.num_rows} rows of "
                                 f"data.max_seq_len={self.data.max_seq_len}, fewer than the {world_size} workers; "
                                 "add data, use fewer workers or set data.packing=false")
        return [ray.put(rows.take(pa.array(mine))) for mine in deal(rows.num_rows, world_size)]

    def rank_rows(self, pass_index: int, rank: int, world_size: int) -> list:
        """[a reference to this rank's rows of pass `pass_index`, dealt to `world_size` ranks] (in a list: Ray would
        resolve a bare one). An elastic run's group that changed size gets passes dealt to its new size; the
        sizes before the last two are dropped."""
        self._wait_for_data()
        with self._lock:
            if world_size not in self._passes:  # a resized group: it resumes mid-run, nothing to build ahead
                self._passes[world_size] = self._cache(world_size, first_pass=None)
                while len(self._passes) > 2:  # the group before the last may still have a late ask in flight
                    del self._passes[next(iter(self._passes))]
            passes = self._passes[world_size]
        return [passes.rank_rows(pass_index, rank)]

    def first_pass_figures(self) -> dict[str, float]:
        """Rows each rank trains per pass and how full they are, from pass 0; raises what building it raised
        (the driver asks as soon as it has loaded the rows)."""
        [ref] = self.rank_rows(0, 0, self.world_size)
        rows = ray.get(ref)
        sides = 2 if "chosen_input_ids" in rows.column_names else 1  # a preference pair's row holds two sequences
        fill = pc.sum(rows.column("length")).as_py() / max(rows.num_rows * sides * self.data.max_seq_len, 1)
        return {"data_rows_per_worker_per_pass": rows.num_rows, "data_row_fill": fill}


def start_pass_coordinator(world_size: int, data: DataSection):
    """On the driver's node, empty (`load_passes` gives it the rows): the job ends with it anyway, and so does a
    job whose coordinator dies (`--resume` then continues exactly). Not restartable: Ray logs an error line
    for any restartable actor given object references (ray issue 53727), and its token rows are references
    the driver owns. Threads for every rank's rows and eval rows, waiting at once, and the driver's calls."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return PassCoordinator.options(max_concurrency=2 * world_size + 4, scheduling_strategy=here).remote(
        world_size, data)


def load_passes(coordinator, train: TrainData, eval_rows: dict) -> dict[str, float]:
    """Hands the coordinator the token rows and the eval rows; returns the figures of the first pass. A pass
    that cannot be built fails here, in the driver, with its one-line reason."""
    ray.get(coordinator.load.remote([rows.to_arrow_refs() for rows in train.sources], train.plan, train.pad_id,
                                    [ray.put(eval_rows)]))
    try:
        return ray.get(coordinator.first_pass_figures.remote())
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserInputError):
            raise e.cause from None
        raise

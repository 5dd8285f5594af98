"""What one pass over the training data holds: how many rows each source gives it, its seeds, and which
rows each rank trains in which order.

Plain numpy and pyarrow, no Ray: app/data/pipeline.py's PassCoordinator builds each pass with these. A pass draws
`rows_per_pass()[i]` rows from source i (with repetition where a source is smaller than its share),
shuffles them all together with a seed for that pass, packs them into rows (app/data/packing.py) unless
packing is off, and deals the rows to the ranks in turn.
The same seed, pass and worker count give the same rows to each rank, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from app.data.gym_tasks import is_task_source, task_name


@dataclass(frozen=True)
class PassPlan:
    names: tuple[str, ...]  # one per source, for logging
    rows: tuple[int, ...]  # rows each source holds (after dropping rows with no target token)
    weights: tuple[float, ...] | None  # shares of every pass; None: in proportion to the sizes
    seed: int

    def rows_per_pass(self) -> list[int]:
        """Rows drawn from each source per pass: as many in all as the sources hold together."""
        if self.weights is None:
            return list(self.rows)
        total, weight = sum(self.rows), sum(self.weights)
        return [max(1, round(total * w / weight)) for w in self.weights]

    def copies_needed(self, source: int) -> int:
        """How many times source `source` is repeated to fill its share of a pass."""
        return max(1, math.ceil(self.rows_per_pass()[source] / self.rows[source]))

    def source_seed(self, pass_index: int, source: int) -> int:
        return _mix(self.seed, pass_index, source + 1)

    def pass_seed(self, pass_index: int) -> int:
        return _mix(self.seed, pass_index, 0)


def _mix(*values: int) -> int:
    """A 32-bit seed from several integers (Ray Data takes seeds below 2**32)."""
    h = 0x9E3779B9
    for v in values:
        h = (h * 0x01000193 ^ (v & 0xFFFFFFFF)) & 0xFFFFFFFF
    return h


def source_names(paths: list[str]) -> tuple[str, ...]:
    """Short, distinct names for the sources: the file or directory name, numbered where they repeat."""
    stems = [task_name(p) if is_task_source(p) else Path(p.rstrip("/")).stem or p for p in paths]
    return tuple(s if stems.count(s) == 1 else f"{s}-{i}" for i, s in enumerate(stems))


def source_key(name: str) -> str:
    """A source's name as a metric key (data_share/<key>): MLflow takes letters, digits and _ - . space in a
    metric name's segment; anything else (a Hive partition's '=', '+', '(', ',', '@') becomes '_'. The names as
    the user wrote them are the run's tag data.source_keys."""
    return re.sub(r"[^\w.\- ]", "_", name).strip(". ") or "source"


def pass_records(plan: PassPlan, pass_index: int, shuffle: bool) -> np.ndarray:
    """The (source, row) pairs of pass `pass_index`, in training order: each source's share drawn (repeats where
    the share is larger than the source), shuffled together with the pass's seed. Plain numpy: the same
    inputs, the same order."""
    picks = []
    for source, (rows, wanted) in enumerate(zip(plan.rows, plan.rows_per_pass())):
        rng = np.random.default_rng(plan.source_seed(pass_index, source))
        copies = [rng.permutation(rows) if shuffle else np.arange(rows) for _ in range(plan.copies_needed(source))]
        picks.append(np.stack([np.full(wanted, source), np.concatenate(copies)[:wanted]], axis=1))
    order = np.concatenate(picks)
    if shuffle:
        order = order[np.random.default_rng(plan.pass_seed(pass_index)).permutation(len(order))]
    return order


def deal(rows: int, world_size: int) -> list[np.ndarray]:
    """Row indices of each rank's rows: dealt in turn (rank r: rows r, r + W, ...), the remainder left
    out so every rank takes as many steps. Dealt, not cut: after each rank has trained k rows, the pass's
    first k x W rows are done, whatever W was, so a resume on another worker count skips exactly those
    (`rank_rows_among_first` says how many of each rank's rows)."""
    return [np.arange(r, rows - rows % world_size, world_size) for r in range(world_size)]


def rank_rows_among_first(rows: int, rank: int, world_size: int) -> int:
    """How many of `rank`'s rows (rows rank, rank + W, ...) are among the pass's first `rows`: what a
    rank resumed after those were trained skips, exactly, whatever the worker count that trained them."""
    return max(rows - rank + world_size - 1, 0) // world_size


def pass_order(plan: PassPlan, pass_index: int, world_size: int, shuffle: bool) -> list[np.ndarray]:
    """For each rank, the (source, row) pairs of its rows of pass `pass_index` (unpacked rows), in order."""
    order = pass_records(plan, pass_index, shuffle)
    return [order[mine] for mine in deal(len(order), world_size)]


def take_rows(tables: list[pa.Table], order: np.ndarray) -> pa.Table:
    """The rows `order` names ((source, row) pairs), in that order, from each source's table."""
    parts, positions = [], []
    for source, table in enumerate(tables):
        mine = np.flatnonzero(order[:, 0] == source)
        if len(mine):
            parts.append(table.take(pa.array(order[mine, 1])))
            positions.append(mine)
    combined = pa.concat_tables(parts)
    return combined.take(pa.array(np.argsort(np.concatenate(positions), kind="stable")))

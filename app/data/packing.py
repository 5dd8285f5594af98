"""Packing: several tokenized records in one training row, each attending only to itself.

A pass's records (in training order) go first-fit into a bounded set of open rows of `max_seq_len`
tokens; when a record fits in none and the set is full, the fullest open row is closed. Every record keeps
its own position ids (0, 1, ...), so the attention kernels see where one ends and the next begins:
transformers builds a block-diagonal causal mask from restarting position ids when no attention mask is
given (SDPA, eager and flex attention on any device), and FlashAttention takes the same rows as varlen
sequences. The first label of each record is masked, so no record learns to predict the next one.

Numpy over Ray Data's tensor columns: the pass coordinator packs each whole pass before dealing its rows to the ranks,
so every worker count sees the same packed rows and a resume stays exact.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from ray.data.block import BlockAccessor
from ray.data.extensions import ArrowTensorArray

from app.data.chat import IGNORE_INDEX


def first_fit(lengths: np.ndarray, row_len: int, open_rows: int) -> list[list[int]]:
    """Indices of the records in each packed row, rows in the order they were closed."""
    closed: list[list[int]] = []
    members: list[list[int]] = [[] for _ in range(open_rows)]
    free = np.full(open_rows, -1, dtype=np.int64)  # room left in each open row; -1: no row in that slot
    for i, length in enumerate(lengths.tolist()):
        fits = np.flatnonzero(free >= length)
        if len(fits):
            slot = fits[0]
        else:
            empty = np.flatnonzero(free < 0)
            if len(empty):
                slot = empty[0]
            else:  # close the fullest open row to make room
                slot = int(np.argmin(free))
                closed.append(members[slot])
            members[slot], free[slot] = [], row_len
        members[slot].append(i)
        free[slot] -= length
        if free[slot] == 0:
            closed.append(members[slot])
            free[slot] = -1
    still_open = sorted((m for m, room in zip(members, free.tolist()) if room >= 0), key=lambda m: m[0])
    return closed + still_open


def pack_rows(table: pa.Table, row_len: int, pad_id: int, sources: int, open_rows: int) -> pa.Table:
    """Token rows (input_ids, labels, length, source) -> packed rows: input_ids, labels, position_ids,
    `length` (real tokens in the row) and `records` (how many records of each source it holds)."""
    columns = BlockAccessor.for_block(table).to_numpy()
    lengths, ids_in, labels_in, source = (columns[c] for c in ("length", "input_ids", "labels", "source"))
    packed = first_fit(lengths, row_len, open_rows)
    ids = np.full((len(packed), row_len), pad_id, dtype=np.int64)
    labels = np.full((len(packed), row_len), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((len(packed), row_len), dtype=np.int64)
    records = np.zeros((len(packed), sources), dtype=np.int64)
    for row, members in enumerate(packed):
        start = 0
        for i in members:
            n = lengths[i]
            ids[row, start:start + n] = ids_in[i, :n]
            labels[row, start + 1:start + n] = labels_in[i, 1:n]  # the record's first token has no context
            positions[row, start:start + n] = np.arange(n)
            records[row, source[i]] += 1
            start += n
        positions[row, start:] = np.arange(row_len - start)  # padding: a sequence of its own, no loss
    return pa.table({"input_ids": ArrowTensorArray.from_numpy(ids), "labels": ArrowTensorArray.from_numpy(labels),
                     "position_ids": ArrowTensorArray.from_numpy(positions),
                     "length": pa.array([int(lengths[m].sum()) for m in packed], type=pa.int64()),
                     "records": ArrowTensorArray.from_numpy(records)})


def unpacked_rows(table: pa.Table, sources: int) -> pa.Table:
    """One record per row, with the same `records` column as packed rows (a one-hot of its source)."""
    records = np.eye(sources, dtype=np.int64)[table.column("source").to_numpy()]
    return table.drop_columns(["source"]).append_column("records", ArrowTensorArray.from_numpy(records))

"""The data position a checkpoint records, and what a resumed stream skips (plain Python, no Ray)."""

import pytest
import torch

from app.data.chat import IGNORE_INDEX
from app.data.stream import RankStream


def _shard(rows: int, batch: int, offset: int = 0):
    """A pass over `rows` numbered rows in batches: row numbers travel in input_ids."""
    def one_pass(pass_index: int):
        ids = torch.arange(offset, offset + rows)
        return [{"input_ids": ids[i:i + batch, None], "labels": ids[i:i + batch, None]} for i in range(0, rows, batch)]
    return one_pass


def _rows(stream, batches: int) -> list[int]:
    return [int(r) for _ in range(batches) for r in next(stream)["input_ids"][:, 0]]


def test_a_resumed_stream_continues_where_the_checkpoint_stood():
    stream = RankStream(_shard(20, 4), torch.device("cpu"))
    _rows(stream, 3)
    pass_index, position = stream.pass_index, stream.rows_into_pass  # what a checkpoint records (one rank)
    expected = _rows(stream, 4)
    resumed = RankStream(_shard(20, 4), torch.device("cpu"), pass_index, skip_rows=position)
    assert _rows(resumed, 4) == expected  # no row trained twice, none skipped
    assert (resumed.pass_index, resumed.rows_into_pass) == (stream.pass_index, stream.rows_into_pass)


def test_passes_repeat_and_a_resume_on_fewer_ranks_skips_the_global_rows():
    stream = RankStream(_shard(8, 4), torch.device("cpu"))
    assert _rows(stream, 3) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # pass 2 starts over
    assert (stream.pass_index, stream.rows_into_pass) == (1, 4)
    # Two ranks had each trained on 4 rows of this pass: 8 global rows. Resumed on one rank holding
    # all 16 rows of the pass, it skips those 8 and trains on the rest.
    global_rows = stream.rows_into_pass * 2
    resumed = RankStream(_shard(16, 4), torch.device("cpu"), pass_index=1, skip_rows=global_rows // 1)
    assert _rows(resumed, 2) == list(range(8, 16))


def test_a_checkpoint_inside_a_batch_resumes_with_the_rest_of_it():
    resumed = RankStream(_shard(12, 4), torch.device("cpu"), skip_rows=6)  # 6 rows done; batches of 4
    assert _rows(resumed, 2) == list(range(6, 12))  # rows 6-7 (the rest of a batch), then 8-11
    assert resumed.rows_into_pass == 12


def _dealt(rows: int, batch: int, rank: int, world: int):
    """Rank `rank`'s shard of a pass over rows 0..rows-1 dealt to `world` ranks (rows rank, rank + W, ...), in
    batches; row numbers travel in input_ids and labels."""
    def one_pass(pass_index: int):
        ids = torch.arange(rank, rows - rows % world, world)
        return [{"input_ids": ids[i:i + batch, None], "labels": ids[i:i + batch, None]}
                for i in range(0, len(ids), batch)]
    return one_pass


def _trained(batch: dict) -> list[int]:
    """The rows of a batch that carry targets (a stand-in row has none)."""
    return [int(r) for r, labels in zip(batch["input_ids"][:, 0], batch["labels"]) if (labels != IGNORE_INDEX).any()]


@pytest.mark.parametrize("before, after, batch_before, batch_after, steps, stand_ins", [
    (3, 2, 5, 5, 1, 0),  # 15 rows trained; on 2 ranks rank 0 holds 8 of them, rank 1 7: the rest of a batch each
    (3, 2, 5, 4, 1, 1),  # the same, batches of 4: rank 0's 8 end a batch, so a stand-in row keeps it in step
    (2, 3, 3, 1, 2, 0),  # 12 rows: 4 on each of 3 ranks
    (4, 3, 1, 1, 5, 2),  # 20 rows: 7, 7 and 6; batches of one row, so ranks 0 and 1 take a stand-in
    (3, 4, 1, 3, 3, 1),  # 9 rows: 3, 2, 2 and 2
])
def test_a_pass_resumed_on_another_worker_count_trains_every_row_once(before, after, batch_before, batch_after,
                                                                      steps, stand_ins):
    rows = 41
    first = [RankStream(_dealt(rows, batch_before, r, before), torch.device("cpu"), rank=r, world_size=before)
             for r in range(before)]
    trained = [row for stream in first for _ in range(steps) for row in _trained(next(stream))]
    position = first[0].rows_into_pass  # what the checkpoint records
    assert position == before * batch_before * steps == len(trained)
    resumed = [RankStream(_dealt(rows, batch_after, r, after), torch.device("cpu"), 0, position, r, after)
               for r in range(after)]
    assert all(stream.rows_into_pass == position for stream in resumed)
    seen_stand_ins = 0
    while True:
        batches = [next(stream) for stream in resumed]  # one micro-batch per rank, as a step takes them
        assert len({(stream.pass_index, stream.rows_into_pass) for stream in resumed}) == 1  # the ranks in step
        if resumed[0].pass_index:
            break
        trained += [row for batch in batches for row in _trained(batch)]
        seen_stand_ins += sum(len(batch["input_ids"]) - len(_trained(batch)) for batch in batches)
    assert sorted(trained) == list(range(rows - rows % after))  # none twice, none missed (bar the set-aside)
    assert seen_stand_ins == stand_ins

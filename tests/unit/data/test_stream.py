"""The data position a checkpoint records, and what a resumed stream skips (plain Python, no Ray)."""

import torch

from app.data.stream import ShardStream


def _shard(rows: int, batch: int, offset: int = 0):
    """A pass over `rows` numbered rows in batches: row numbers travel in input_ids."""
    def one_pass(epoch: int):
        ids = torch.arange(offset, offset + rows)
        return [{"input_ids": ids[i:i + batch, None], "labels": ids[i:i + batch, None]} for i in range(0, rows, batch)]
    return one_pass


def _rows(stream, batches: int) -> list[int]:
    return [int(r) for _ in range(batches) for r in next(stream)["input_ids"][:, 0]]


def test_a_resumed_stream_continues_where_the_checkpoint_stood():
    stream = ShardStream(_shard(20, 4), torch.device("cpu"))
    _rows(stream, 3)
    epoch, position = stream.epoch, stream.rows_into_epoch  # what a checkpoint records (one rank)
    expected = _rows(stream, 4)
    resumed = ShardStream(_shard(20, 4), torch.device("cpu"), epoch, skip_rows=position)
    assert _rows(resumed, 4) == expected  # no row trained twice, none skipped
    assert (resumed.epoch, resumed.rows_into_epoch) == (stream.epoch, stream.rows_into_epoch)


def test_passes_repeat_and_a_resume_on_fewer_ranks_skips_the_global_rows():
    stream = ShardStream(_shard(8, 4), torch.device("cpu"))
    assert _rows(stream, 3) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # pass 2 starts over
    assert (stream.epoch, stream.rows_into_epoch) == (1, 4)
    # Two ranks had each trained on 4 rows of this pass: 8 global rows. Resumed on one rank holding
    # all 16 rows of the pass, it skips those 8 and trains on the rest.
    global_rows = stream.rows_into_epoch * 2
    resumed = ShardStream(_shard(16, 4), torch.device("cpu"), epoch=1, skip_rows=global_rows // 1)
    assert _rows(resumed, 2) == list(range(8, 16))


def test_a_checkpoint_inside_a_batch_resumes_with_the_rest_of_it():
    resumed = ShardStream(_shard(12, 4), torch.device("cpu"), skip_rows=6)  # 6 rows done; batches of 4
    assert _rows(resumed, 2) == list(range(6, 12))  # rows 6-7 (the rest of a batch), then 8-11
    assert resumed.rows_into_epoch == 12

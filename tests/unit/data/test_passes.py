"""What each pass over the data draws from each source (plain arithmetic; the Ray side is in
tests/integration/test_data_pipeline.py)."""

import numpy as np
import pyarrow as pa

from app.data.passes import PassPlan, pass_order, source_names, take_rows


def test_a_single_source_or_unweighted_mixture_is_one_epoch_per_pass():
    assert PassPlan(("a",), (100,), None, 0).rows_per_pass() == [100]
    assert PassPlan(("a", "b"), (100, 300), None, 0).rows_per_pass() == [100, 300]


def test_weights_set_each_sources_share_and_small_sources_repeat():
    plan = PassPlan(("big", "small"), (900, 100), (0.5, 0.5), 0)
    assert plan.rows_per_pass() == [500, 500]
    assert (plan.copies_needed(0), plan.copies_needed(1)) == (1, 5)


def test_seeds_differ_by_pass_and_source_and_fit_in_32_bits():
    plan = PassPlan(("a", "b"), (10, 10), None, seed=7)
    seeds = {plan.pass_seed(0), plan.pass_seed(1), plan.source_seed(0, 0), plan.source_seed(0, 1)}
    assert len(seeds) == 4 and all(0 <= s < 2**32 for s in seeds)
    assert plan.pass_seed(3) == PassPlan(("a", "b"), (10, 10), None, seed=7).pass_seed(3)


def test_source_names_are_short_and_distinct():
    assert source_names(["/d/alpaca.json", "s3://b/sharegpt.jsonl"]) == ("alpaca", "sharegpt")
    assert source_names(["/x/train.jsonl", "/y/train.jsonl"]) == ("train-0", "train-1")


def test_the_rows_trained_so_far_are_the_head_of_the_pass_for_any_worker_count():
    """Two ranks each trained 10 rows; the run resumes on four, each skipping 5 of its own rows: the rows
    left are exactly the ones not trained, none twice."""
    plan = PassPlan(("a",), (100,), None, seed=3)
    trained = [tuple(row) for shard in pass_order(plan, 0, 2, shuffle=True) for row in shard[:10]]
    left = [tuple(row) for shard in pass_order(plan, 0, 4, shuffle=True) for row in shard[5:]]
    assert len(set(trained)) == 20 and set(trained).isdisjoint(left) and len(set(trained) | set(left)) == 100


def test_shards_are_equal_and_a_pass_takes_each_sources_share():
    plan = PassPlan(("big", "small"), (90, 10), (0.5, 0.5), seed=0)
    shards = pass_order(plan, 0, 3, shuffle=True)
    assert [len(s) for s in shards] == [33, 33, 33]  # 100 rows dealt to 3 ranks: one set aside
    sources = np.concatenate(shards)[:, 0]
    assert abs((sources == 1).sum() - 50) <= 1  # the small source repeated to fill its half
    assert not np.array_equal(np.concatenate(shards), np.concatenate(pass_order(plan, 1, 3, shuffle=True)))


def test_take_rows_gathers_in_the_given_order_across_sources():
    tables = [pa.table({"x": [0, 1, 2]}), pa.table({"x": [10, 11]})]
    order = np.array([[1, 1], [0, 2], [1, 0], [0, 0]])
    assert take_rows(tables, order).column("x").to_pylist() == [11, 2, 10, 0]

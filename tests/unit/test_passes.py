"""What each pass over the data draws from each source (plain arithmetic; the Ray side is in
tests/integration/test_data_pipeline.py)."""

from app.passes import PassPlan, source_names


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

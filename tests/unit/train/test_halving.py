"""Successive halving of adapters in one job (`jobs.tune --in-one-job`): the rungs where Ray Tune's ASHA puts them,
its cutoff, and the trials drawn by Tune's own variant generator."""

import math

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from app.launch.adapter_sweep import trial_adapters
from app.train.halving import behind, rung_at
from tests.helpers import EMBEDDED_CONFIG

ONE_JOB = ["adapters=[{name: a1}]", "tune.in_one_job=true", "train.max_steps=100", "train.eval_every=10"]


def test_rungs_sit_at_grace_times_reduction_factor_powers_decided_at_the_next_evaluation():
    cfg = load_config(EMBEDDED_CONFIG, ONE_JOB)
    assert {step: rung_at(cfg, step) for step in range(0, 101, 10) if rung_at(cfg, step) is not None} == {
        10: 0, 20: 1, 40: 2, 80: 3}
    later = load_config(EMBEDDED_CONFIG, [*ONE_JOB, "tune.grace_period=15", "tune.reduction_factor=3"])
    assert {step: rung_at(later, step) for step in range(0, 101, 10) if rung_at(later, step) is not None} == {
        20: 0, 50: 1}  # milestones 15 and 45, each at the first evaluation after it (135 is past the run)
    assert rung_at(load_config(EMBEDDED_CONFIG, [*ONE_JOB, "tune.scheduler=fifo"]), 10) is None


def test_the_cutoff_keeps_one_in_reduction_factor_and_never_a_figure_that_is_not_a_number():
    cfg = load_config(EMBEDDED_CONFIG, ONE_JOB)  # best_metric eval_exact_match: higher is better
    losses = load_config(EMBEDDED_CONFIG, [*ONE_JOB, "train.best_metric=eval_loss", "eval.generation_rows=0"])
    figures = {f"t{i}": float(i) for i in range(8)}
    assert sorted(behind(cfg, figures)) == ["t0", "t1", "t2", "t3"]
    assert sorted(behind(losses, figures)) == ["t4", "t5", "t6", "t7"]
    assert sorted(behind(losses, {"a": 1.0, "b": math.nan, "c": 2.0})) == ["b", "c"]
    assert behind(losses, {"only": 3.0}) == {}


def test_trials_are_drawn_by_tunes_variant_generator_as_adapters():
    space = ["tune.space={train.learning_rate: 'grid(1e-3,2e-3)', lora.r: 'grid(4,8)', lora.dropout: "
             "'uniform(0,0.1)'}", "tune.num_samples=2", "tune.seed=3"]
    cfg = load_config(EMBEDDED_CONFIG, space)
    trials = trial_adapters(cfg)
    assert [t["name"] for t in trials] == [f"trial_{i:03d}" for i in range(8)]
    assert sorted((t["learning_rate"], t["r"]) for t in trials) == sorted([(lr, r) for lr in (1e-3, 2e-3)
                                                                          for r in (4, 8)] * 2)
    assert all(0 <= t["dropout"] < 0.1 for t in trials) and trial_adapters(cfg) == trials  # seeded
    shared = load_config(EMBEDDED_CONFIG, ["tune.space={data.max_seq_len: 'grid(32,64)'}"])
    with pytest.raises(UserInputError, match="tune.space data.max_seq_len is the job's"):
        trial_adapters(shared)

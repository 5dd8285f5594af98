"""The `tune:` section and a sweep's space: each mistake one line naming the key, checked before any trial."""

from __future__ import annotations

import pytest

from app.config.loading import load_config
from app.config.sweep_space import check_space, with_values
from app.config.tune import Dimension, parse_dimension
from app.errors import UserInputError
from tests.helpers import EMBEDDED_CONFIG


def sweep(*overrides: str):
    return load_config(EMBEDDED_CONFIG, list(overrides))


@pytest.mark.parametrize("text, expected", [
    ("loguniform(1e-4,3e-3)", Dimension("loguniform", (1e-4, 3e-3))),
    ("uniform(0, 0.1)", Dimension("uniform", (0, 0.1))),
    ("randint(1,4)", Dimension("randint", (1, 4))),
    ("choice(8,16,32)", Dimension("choice", (8, 16, 32))),
    ("grid(all-linear,[q_proj])", Dimension("grid", ("all-linear", ["q_proj"]))),
])
def test_distributions_read_as_written(text, expected):
    assert parse_dimension("k", text) == expected


@pytest.mark.parametrize("text, says", [
    ("logunifrm(1e-4,3e-3)", "expected one of grid, choice"),
    ("loguniform(0,1)", "both above 0"),
    ("uniform(2,1)", "needs low < high"),
    ("randint(1.5,4)", "whole numbers"),
    ("uniform(1)", "takes two numbers"),
    ("choice()", "needs at least one value"),
])
def test_a_bad_distribution_is_one_line_naming_the_key(text, says):
    with pytest.raises(UserInputError, match=says) as raised:
        sweep(f"tune.space={{train.learning_rate: '{text}'}}")
    assert "tune.space train.learning_rate=" in str(raised.value) and "\n" not in str(raised.value)


def test_every_value_a_trial_may_take_is_checked_against_the_config_before_the_sweep():
    check_space(sweep("tune.space={train.learning_rate: 'loguniform(1e-4,3e-3)', lora.r: 'choice(8,16)'}"))
    with pytest.raises(UserInputError, match=r"lora.r=choice\(8,0\) at 0: lora.r: Input should be greater than 0"):
        check_space(sweep("tune.space={lora.r: 'choice(8,0)'}"))
    with pytest.raises(UserInputError, match="at 24: train.global_batch_size=24 must be a multiple"):
        check_space(sweep("tune.space={train.global_batch_size: 'choice(32,24)'}"))
    with pytest.raises(UserInputError, match="train.learnin_rate is not a config key a trial can set"):
        check_space(sweep("tune.space={train.learnin_rate: 'choice(1e-3)'}"))
    with pytest.raises(UserInputError, match=r"train.run_name is not a config key a trial can set \(the sweep sets"):
        check_space(sweep("tune.space={train.run_name: 'choice(a,b)'}"))
    with pytest.raises(UserInputError, match="tune.space is empty"):
        check_space(sweep())


def test_the_sweeps_settings_that_contradict_the_config_or_each_other_are_refused():
    with pytest.raises(UserInputError, match="tune.scheduler=pbt needs tune.perturb"):
        sweep("tune.scheduler=pbt")
    with pytest.raises(UserInputError, match="tune.perturb lora.r: PBT can change only"):
        sweep("tune.space={lora.r: 'choice(8,16)'}", "tune.perturb=[lora.r]")
    with pytest.raises(UserInputError, match="tune.perturb train.learning_rate: not in tune.space"):
        sweep("tune.perturb=[train.learning_rate]")
    with pytest.raises(UserInputError, match="tune.metric=eval_reward is not an evaluation figure"):
        sweep("tune.space={lora.r: 'choice(8)'}", "tune.metric=eval_reward")
    with pytest.raises(UserInputError, match="tune.perturbation_interval=30 must be a multiple of train.eval_every"):
        sweep("tune.space={train.learning_rate: 'choice(1e-3)'}", "tune.scheduler=pbt", "tune.perturbation_interval=30",
              "tune.perturb=[train.learning_rate]")


def test_a_trials_values_make_a_new_validated_config():
    cfg = with_values(sweep(), {"train.learning_rate": 1e-3, "lora.r": 8})
    assert cfg.train.learning_rate == 1e-3 and cfg.lora.r == 8

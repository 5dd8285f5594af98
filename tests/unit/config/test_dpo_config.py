"""The dpo section and train.objective: defaults, the shipped DPO config, and one-line errors."""

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from tests.helpers import EMBEDDED_CONFIG


def test_the_defaults_train_sft_with_the_dpo_papers_loss_ready():
    cfg = load_config(EMBEDDED_CONFIG, ["dpo.loss_type=ipo", "dpo.beta=0.5"])
    assert cfg.train.objective == "sft"
    assert (cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.label_smoothing) == (0.5, "ipo", 0.0)
    assert load_config(None).dpo.model_dump() == {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0}
    assert load_config(None, ["dpo.label_smoothing=0.1"]).flat()["dpo.label_smoothing"] == 0.1  # an MLflow param


@pytest.mark.parametrize("override, message", [
    ("dpo.beta=0", "dpo.beta: Input should be greater than 0"),
    ("dpo.loss_type=kto", "dpo.loss_type: Input should be 'sigmoid', 'ipo' or 'hinge'"),
    ("dpo.label_smoothing=0.5", "dpo.label_smoothing: Input should be less than 0.5"),
    ("dpo.betta=0.2", "unknown key (did you mean dpo.beta?)"),
    ("train.objective=ppo", "train.objective: Input should be 'sft', 'dpo', 'grpo' or 'distill'"),
])
def test_bad_dpo_values_get_one_line_naming_the_key(override, message):
    with pytest.raises(UserInputError) as e:
        load_config(EMBEDDED_CONFIG, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_label_smoothing_is_refused_for_the_losses_it_does_not_apply_to():
    with pytest.raises(UserInputError, match=r"dpo.label_smoothing=0.1 applies to dpo.loss_type=sigmoid only .*"
                                             r"set it to 0 for dpo.loss_type=hinge$"):
        load_config(None, ["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"])


DPO_CONFIG = EMBEDDED_CONFIG.parent / "embedded_dpo.yaml"


def test_the_shipped_dpo_config_reads_pairs_unpacked_and_ranks_by_reward_accuracy():
    cfg = load_config(DPO_CONFIG)
    assert (cfg.train.objective, cfg.data.format, cfg.data.packing) == ("dpo", "preference", False)
    assert cfg.train.best_metric == "eval_rewards/accuracies"
    margins = load_config(DPO_CONFIG, ["train.best_metric=eval_rewards/margins"])
    assert margins.train.best_metric == "eval_rewards/margins"


@pytest.mark.parametrize("overrides, message", [
    (["train.objective=dpo", "data.packing=true"], "data.packing=true: preference pairs are not packed"),
    (["train.objective=dpo", "data.format=chat"], "data.format=chat holds no preference pairs"),
    (["train.objective=dpo", "data.long_records=split"], "data.long_records=split: a preference pair is truncated"),
    (["data.format=preference"], "data.format=preference holds pairs to prefer one answer of: set train.objective=dpo"),
    (["train.objective=dpo", "train.best_metric=eval_perplexity", "eval.generation_rows=0"],
     "train.best_metric=eval_perplexity is not an evaluation figure of this config: use one of eval_loss, "
     "eval_rewards/accuracies, eval_rewards/margins"),
])
def test_an_objective_the_data_cannot_feed_is_one_line(overrides, message):
    with pytest.raises(UserInputError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)

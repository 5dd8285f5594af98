"""The dpo section and train.objective: defaults, one-line errors, and the refusal of an objective not wired yet."""

import pytest

from app.config.schema import load_config
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
    ("train.objective=ppo", "train.objective: Input should be 'sft' or 'dpo'"),
])
def test_bad_dpo_values_get_one_line_naming_the_key(override, message):
    with pytest.raises(UserInputError) as e:
        load_config(EMBEDDED_CONFIG, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_label_smoothing_is_refused_for_the_losses_it_does_not_apply_to():
    with pytest.raises(UserInputError, match=r"dpo.label_smoothing=0.1 applies to dpo.loss_type=sigmoid only .*"
                                             r"set it to 0 for dpo.loss_type=hinge$"):
        load_config(None, ["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"])


def test_dpo_is_refused_until_the_recipe_runs_it_so_nothing_silently_trains_sft():
    with pytest.raises(UserInputError) as e:
        load_config(EMBEDDED_CONFIG, ["train.objective=dpo"])
    assert "train.objective=dpo: the DPO training loop is not wired into the recipe yet" in str(e.value)
    assert "\n" not in str(e.value)

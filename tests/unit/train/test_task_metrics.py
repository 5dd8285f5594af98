import pytest

from app.config.sections import is_metric_spec, metric_name
from app.errors import UserInputError
from app.train.task_metrics import resolve, score


def test_builtin_metrics_score_each_row_and_average():
    predictions = ["three hundred", "seven ", "twelve and more"]
    references = ["three  hundred", "eight", "twelve"]
    assert score(predictions, references, ["exact_match", "contains"]) == {
        "eval_exact_match": pytest.approx(1 / 3), "eval_contains": pytest.approx(2 / 3)}


def test_a_user_function_is_imported_and_named_after_itself():
    spec = "tests.unit.train.test_task_metrics:first_word_matches"
    assert is_metric_spec(spec) and metric_name(spec) == "eval_first_word_matches"
    assert score(["a b", "c d"], ["a x", "x d"], [spec]) == {"eval_first_word_matches": 0.5}


def first_word_matches(prediction: str, reference: str) -> float:
    return float(prediction.split()[:1] == reference.split()[:1])


def test_a_metric_that_cannot_be_imported_is_a_one_line_error_naming_the_field():
    with pytest.raises(UserInputError, match=r"^eval.metrics: cannot import no_such_module:f .*") as e:
        resolve("no_such_module:f")
    assert "\n" not in str(e.value)
    assert not is_metric_spec("exact match") and not is_metric_spec("module.function")

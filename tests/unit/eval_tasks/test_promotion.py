"""The promotion gate: the decision rule, and `python -m jobs.promote` against a real local MLflow registry
with two registered adapters scored by lm-eval's Hugging Face backend on the embedded spelling task: the first
becomes the champion, a candidate that does not win by the margin is refused with exit code 3 and the reason in
one line, and every score and decision is on the versions."""

from __future__ import annotations

import mlflow
import pytest

from app.eval_tasks.promotion import NOT_PROMOTED, decide
from tests.helpers import register_adapter

NAME = "speller-gate"
METRIC = "embedded_spelling_choice/acc"


@pytest.mark.parametrize(("candidate", "champion", "min_gain", "higher", "promoted"), [
    (0.5, None, 0.0, True, True),  # no champion yet
    (0.80, 0.75, 0.0, True, True),
    (0.80, 0.75, 0.1, True, False),  # a gain, smaller than asked
    (0.75, 0.75, 0.0, True, False),  # a tie does not replace the champion
    (0.70, 0.75, 0.0, True, False),
    (1.2, 1.5, 0.2, False, True),  # lower is better (a loss, a perplexity)
    (1.5, 1.2, 0.0, False, False),
])
def test_the_gate_opens_only_for_a_gain_of_at_least_the_margin(candidate, champion, min_gain, higher, promoted):
    decision = decide("lm_eval/t/m", candidate, champion, min_gain, higher)
    assert decision.promote is promoted and "\n" not in decision.reason
    assert decision.reason.startswith("promoted" if promoted and champion is not None else
                                      "the candidate" if promoted else "not promoted")


@pytest.fixture
def registry(embedded, adapters, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    versions = [register_adapter(embedded, adapters[name], tmp_path / name, uri, NAME) for name in ("noisy", "other")]
    yield mlflow.tracking.MlflowClient(uri), versions
    mlflow.set_tracking_uri(None)


def _promote(capsys, version: str, *more: str) -> tuple[int, list[str]]:
    from jobs.promote import main

    code = main([NAME, "--candidate", version, "--metric", METRIC, "--limit", "24", *more])
    return code, capsys.readouterr().out.strip().splitlines()


@pytest.mark.slow
def test_promote_makes_the_first_champion_then_gates_the_next_on_its_score(registry, capsys):
    client, (first, second) = registry
    code, _ = _promote(capsys, first)
    assert code == 0 and str(client.get_model_version_by_alias(NAME, "champion").version) == first
    tags = client.get_model_version(NAME, first).tags
    assert tags["promotion.decision"] == "promoted" and f"lm_eval/{METRIC}" in tags

    code, lines = _promote(capsys, second, "--min-gain", "2")  # no accuracy gains 2
    assert code == NOT_PROMOTED and lines[-2].startswith("not promoted: ") and "version 2" in lines[-2]
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == first
    assert client.get_model_version(NAME, second).tags["promotion.decision"] == "not promoted"
    run = client.get_run(client.get_model_version(NAME, second).run_id)
    assert f"lm_eval/{METRIC}" in run.data.metrics  # the score is on the run that trained it too

    code, lines = _promote(capsys, second)
    scores = {v: float(client.get_model_version(NAME, v).tags[f"lm_eval/{METRIC}"]) for v in (first, second)}
    assert (code == 0) is (scores[second] > scores[first]), (code, scores, lines[-2])
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == (second if code == 0 else first)


def test_a_malformed_metric_is_one_line_before_anything_is_scored(capsys):
    from jobs.promote import main

    with pytest.raises(SystemExit) as stopped:
        main([NAME, "--candidate", "1", "--metric", "acc"])
    assert stopped.value.code == 2 and "expected TASK/METRIC" in capsys.readouterr().err

"""Each objective owns what differs by train.objective: the rest of the code asks its Objective
(app/config/objectives.py) or its worker side (app/train/objectives.py), never compares the name."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from app.config.loading import load_config
from app.config.objectives import OBJECTIVES
from app.config.schema import FinetuneConfig
from app.config.sections import TrainSection
from app.errors import UserInputError
from app.launch.grid_sweep import results_table
from app.train.objectives import TRAINERS, objective_for

REPO = Path(__file__).resolve().parents[3]
OWNERS = {"app/config/objectives.py", "app/train/objectives.py"}
BY_NAME = re.compile(r"\.objective\s*(==|!=|\bin\b)|\[[\w.]*\.objective\]|\.get\([\w.]*\.objective\)")


def test_every_objective_a_config_may_name_has_its_row_and_its_class():
    assert set(typing.get_args(TrainSection.model_fields["objective"].annotation)) == set(OBJECTIVES)
    assert {row.trainer for row in OBJECTIVES.values()} == set(TRAINERS)
    assert all(row.section is None or row.section in FinetuneConfig.model_fields for row in OBJECTIVES.values())


def test_an_objective_without_its_class_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    cfg = load_config(None, [f"train.output_dir={tmp_path}"])
    monkeypatch.setitem(OBJECTIVES, "sft", dataclasses.replace(OBJECTIVES["sft"], trainer="Missing"))
    with pytest.raises(ValueError, match="train.objective=sft: its row names the class Missing"):
        objective_for(cfg)


def test_no_code_outside_the_objectives_branches_on_the_objectives_name():
    files = [p for folder in ("app", "jobs", "benchmarks") for p in (REPO / folder).rglob("*.py")]
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files if str(p.relative_to(REPO)) not in OWNERS
             for n, line in enumerate(p.read_text().splitlines(), 1) if BY_NAME.search(line)]
    assert found == []
    assert BY_NAME.search('if cfg.train.objective == "grpo":') and BY_NAME.search("{}.get(cfg.train.objective)")


@pytest.mark.parametrize("objective, best", [("sft", "eval_loss"), ("dpo", "eval_loss"), ("grpo", "eval_reward"),
                                             ("distill", "eval_loss")])
def test_best_metric_defaults_to_the_objectives_headline_figure(objective, best, tmp_path):
    sets = [f"train.objective={objective}", f"train.output_dir={tmp_path}"]
    sets += {"grpo": ["grpo.reward_funcs=[jobs/rewards.py:exact_words]"],
             "distill": ["distill.teacher_adapter=outputs/teacher"]}.get(objective, [])
    assert load_config(None, sets).train.best_metric == best


def test_best_metric_must_be_a_figure_the_objective_reports(tmp_path):
    with pytest.raises(UserInputError, match="train.best_metric=eval_reward is not an evaluation figure"):
        load_config(None, ["train.best_metric=eval_reward", f"train.output_dir={tmp_path}"])


def run(name: str, **metrics) -> dict:
    return {"run_name": name, "status": "FINISHED", "params": {}, "metrics": metrics}


def test_a_grid_ranks_its_runs_by_their_best_metric_in_its_direction():
    grpo = [run("a", final_eval_reward=0.4), run("b", final_eval_reward=0.8), run("c")]
    assert results_table(grpo, [], "eval_reward")["run"] == ["b", "a", "c"]
    sft = [run("a", final_eval_loss=0.4), run("b", final_eval_loss=float("nan")), run("c", final_eval_loss=0.2)]
    table = results_table(sft, [], "eval_loss")
    assert table["run"] == ["c", "a", "b"] and table["final_eval_loss"][:2] == [0.2, 0.4]

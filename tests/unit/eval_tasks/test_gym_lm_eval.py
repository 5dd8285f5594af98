"""reasoning-gym tasks in lm-evaluation-harness: an rg:// spec (or rg_TASK) becomes the lm-eval task rg_TASK over the
same problems, and lm-eval's figure is the task's own score_answer of each generated answer. lm-eval's real HF
backend runs on the embedded model (it cannot add, but the path is the same one a real model takes)."""

import json

import pytest
import reasoning_gym

from app.data.gym_tasks import write_task_source
from app.errors import UserInputError
from app.eval_tasks.gym_lm_eval import process_results, with_gym_tasks
from app.eval_tasks.harness import Evaluation, run_harness, scores

pytestmark = pytest.mark.slow

SUMS = "rg://chain_sum?size=6&seed=1000&min_terms=2&max_terms=2&min_digits=1&max_digits=1"


def test_an_rg_spec_is_scored_by_lm_eval_as_the_task_scores_it(embedded, tmp_path):
    evaluation = with_gym_tasks(Evaluation([SUMS, "embedded_spelling"], log_samples=True), folder=str(tmp_path))
    assert evaluation.tasks == ["rg_chain_sum", "embedded_spelling"] and evaluation.include_paths[-1].startswith(
        str(tmp_path))
    results = run_harness(str(embedded["model"]), None, evaluation)
    samples = results["samples"]["rg_chain_sum"]
    problems = [json.loads(line) for line in write_task_source(SUMS, "k").read_text().splitlines()]
    assert sorted(s["doc"]["question"] for s in samples) == sorted(p["prompt"][0]["content"] for p in problems)
    dataset = reasoning_gym.create_dataset("chain_sum", size=6, seed=1000, min_terms=2, max_terms=2, min_digits=1,
                                           max_digits=1)
    by_question = {entry["question"]: entry for entry in dataset}
    own = [dataset.score_answer(_last_number(s["resps"][0][0]), by_question[s["doc"]["question"]]) for s in samples]
    assert scores(results)["lm_eval/rg_chain_sum/score"] == pytest.approx(sum(own) / len(own))


def _last_number(text: str) -> str:
    numbers = [w.strip(".,") for w in text.replace("=", " ").split() if w.strip(".,").lstrip("-").isdigit()]
    return numbers[-1] if numbers else ""


def test_process_results_is_the_tasks_score_of_the_answer_given():
    doc = {"answer": "12", "task": "chain_sum", "metadata": json.dumps({"expression": "5 + 7"})}
    assert process_results(doc, ["The answer is 12."]) == {"score": 1.0}
    assert process_results(doc, ["<answer>11</answer>, not 12"]) == {"score": 0.0}


def test_a_default_rg_task_a_repeated_task_and_a_wrong_spec(tmp_path):
    assert with_gym_tasks(Evaluation(["rg_products"]), folder=str(tmp_path)).tasks == ["rg_products"]
    task = next(tmp_path.rglob("rg_products.yaml")).read_text()
    problems = task.split("file: ", 1)[1].split("\n", 1)[0].strip('"')
    assert len(open(problems).read().splitlines()) == 64  # reasoning-gym's own parameters, 64 problems
    with pytest.raises(UserInputError, match="name one reasoning-gym task more than once"):
        with_gym_tasks(Evaluation(["rg_chain_sum", SUMS]), folder=str(tmp_path))
    with pytest.raises(UserInputError, match=r"--tasks=rg://chain_sum\?seed=1: a reasoning-gym source"):
        with_gym_tasks(Evaluation(["rg://chain_sum?seed=1"]), folder=str(tmp_path))
    assert with_gym_tasks(Evaluation(["embedded_spelling"])).include_paths == []

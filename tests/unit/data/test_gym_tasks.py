"""reasoning-gym tasks as data, reward and metric: the records each objective reads, train and eval kept apart by
content, and the rewards equal to the task's own `score_answer`."""

import json

import pytest
import reasoning_gym

from app.data.formatting import detect_format
from app.data.gym_tasks import (
    answer_match,
    parse_spec,
    questions_of,
    score_answer,
    score_answer_strict,
    task_name,
    write_task_source,
)
from app.data.passes import source_names
from app.errors import UserInputError

SUMS = "rg://chain_sum?size={size}&seed={seed}&min_terms=2&max_terms=2&min_digits=1&max_digits=1"


def records(file) -> list[dict]:
    return [json.loads(line) for line in open(file)]


def test_a_task_source_is_read_as_chat_for_sft_and_as_prompts_for_grpo(tmp_path):
    file = write_task_source(SUMS.format(size=20, seed=3), "data.train_path", cache=str(tmp_path))
    entries = list(reasoning_gym.create_dataset("chain_sum", size=20, seed=3, min_terms=2, max_terms=2,
                                                min_digits=1, max_digits=1))
    rows = records(file)
    assert [r["messages"][0]["content"] for r in rows] == [e["question"] for e in entries]
    assert [r["messages"][1]["content"] for r in rows] == [r["answer"] for r in rows] == [e["answer"] for e in entries]
    assert detect_format(rows[0]) == "chat" and detect_format(rows[0], "prompt") == "prompt_chat"
    assert json.loads(rows[0]["metadata"])["expression"] == entries[0]["metadata"]["expression"]
    assert source_names([SUMS.format(size=20, seed=3), "data/x.jsonl"]) == ("chain_sum", "x")


def test_train_problems_that_ask_an_eval_question_are_left_out_and_said(tmp_path, capsys):
    eval_file = write_task_source(SUMS.format(size=40, seed=1000), "data.eval_path", cache=str(tmp_path))
    held_out = frozenset(questions_of(eval_file))
    train = write_task_source(SUMS.format(size=500, seed=1), "data.train_path", held_out, cache=str(tmp_path))
    asked = {r["messages"][0]["content"] for r in records(train)}
    assert asked and not asked & held_out
    dropped = 500 - len(records(train))
    assert dropped > 0 and f"{dropped} of 500 problems ask an eval question" in capsys.readouterr().err
    one_problem = "rg://chain_sum?size=5&seed=0&min_terms=1&max_terms=1&min_digits=1&max_digits=1"
    everything = frozenset(questions_of(write_task_source(one_problem.replace("size=5", "size=200"), "e",
                                                          cache=str(tmp_path))))
    with pytest.raises(UserInputError, match="too small to keep them apart"):
        write_task_source(one_problem, "data.train_path", everything, cache=str(tmp_path))


@pytest.mark.parametrize("location, problem", [
    ("rg://chain_sum?seed=1", "a reasoning-gym source is rg://TASK"),
    ("rg://no_such_task?size=4&seed=1", "reasoning-gym has no task 'no_such_task'"),
    ("rg://chain_sum?size=4&seed=1&min_terms=3&max_terms=2", "chain_sum refuses"),
    ("rg://chain_sum?size=4&seed=1&colour=blue", "chain_sum refuses"),
])
def test_a_wrong_task_source_is_one_line_naming_the_key(tmp_path, location, problem):
    with pytest.raises(UserInputError, match=problem) as e:
        write_task_source(location, "data.train_path", cache=str(tmp_path))
    assert str(e.value).startswith("data.train_path") and "\n" not in str(e.value)


def test_the_reward_is_the_tasks_own_score_answer(tmp_path):
    """Each completion's reward equals reasoning-gym's score_answer of the answer it gives (TRL's signature: the
    record's columns as lists; conversational completions as messages)."""
    for task, params in (("chain_sum", "&min_terms=2&max_terms=3"), ("products", "&min_terms=2&max_terms=2"),
                         ("basic_arithmetic", "")):
        file = write_task_source(f"rg://{task}?size=6&seed=2{params}", "k", cache=str(tmp_path))
        rows = records(file)
        dataset = reasoning_gym.create_dataset(task, size=6, seed=2, **dict(parse_spec(
            f"rg://{task}?size=6&seed=2{params}", "k").params))
        right = [r["answer"] for r in rows]
        said = [f"Let me think. The answer is {right[0]}.", "I do not know.", "<answer>0</answer>",
                f"<answer>{right[3]}</answer>", "12", right[5]]
        completions = [[{"role": "assistant", "content": text}] for text in said]
        columns = {k: [r[k] for r in rows] for k in ("answer", "task", "metadata")}
        rewards = score_answer(prompts=[r["prompt"] for r in rows], completions=completions, **columns)
        expected = [dataset.score_answer(given, entry) for given, entry in zip(
            [right[0], "", "0", right[3], "12", right[5]], dataset)]
        assert rewards == expected and rewards[0] == 1.0 and rewards[1] == 0.0, task
        strict = score_answer_strict(prompts=None, completions=completions, **columns)
        assert strict == [0.0, 0.0, expected[2], 1.0, 0.0, 0.0]
    assert task_name(SUMS) == "chain_sum"


def test_a_spec_keeps_a_plus_and_reads_json_values():
    spec = parse_spec('rg://basic_arithmetic?size=4&seed=2&operators=["+","*"]&whitespace=single', "k")
    assert dict(spec.params) == {"operators": ["+", "*"], "whitespace": "single"} and (spec.size, spec.seed) == (4, 2)


def test_the_sft_metric_scores_the_answer_a_sentence_gives():
    assert answer_match("The final answer to this arithmetic problem is 12.", "12") == 1.0
    assert answer_match("12", "-12") == 0.0 and answer_match("It is 1,000.00", "1000") == 1.0
    assert answer_match("<answer>blue</answer>", "blue") == 1.0 and answer_match("blue sky", "blue") == 0.0

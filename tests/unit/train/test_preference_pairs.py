"""Pairs a model makes itself: a right answer (the task's own checker scores it 1) against a wrong one, only for
problems with both, in the preference format DPO reads."""

import json

from app.data.formatting import detect_format
from app.data.gym_tasks import write_task_source
from app.train.preference_pairs import right_and_wrong


def test_a_right_answer_is_chosen_over_a_wrong_one_where_a_problem_has_both(tmp_path):
    file = write_task_source("rg://chain_sum?size=3&seed=5&min_terms=2&max_terms=2&min_digits=1&max_digits=1", "k",
                             cache=str(tmp_path))
    records = [json.loads(line) for line in file.read_text().splitlines()]
    right = [r["answer"] for r in records]
    sampled = [[f"It is {int(right[0]) + 1}.", f"The answer is {right[0]}.", "No idea."],  # both: a pair
               [right[1], right[1]],  # always right: no pair
               ["No idea.", "12345"]]  # never right: no pair
    pairs = right_and_wrong(records, sampled, "app.data.gym_tasks:score_answer")
    assert len(pairs) == 1
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": f"The answer is {right[0]}."}]
    assert pairs[0]["rejected"] == [{"role": "assistant", "content": f"It is {int(right[0]) + 1}."}]
    assert pairs[0]["prompt"] == records[0]["prompt"] and detect_format(pairs[0], "preference") == "preference_chat"

"""Preference pairs -> token rows, with the embedded tokenizer (a real BPE tokenizer with a chat template)."""

import copy

import pytest

from app.data.formatting import IGNORE_INDEX
from app.data.preference import detect_preference_format, tokenize_pair, tokenize_pairs, truncate_pair

PAIR = {"prompt": "Write 5 in words.", "chosen": "five", "rejected": "six"}
USER = [{"role": "user", "content": "Write 5 in words."}]


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def tokenizer(embedded):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded["model"])


def _side(tokenizer, rows, side: str, i: int = 0) -> tuple[str, str]:
    """(the row's whole text, the text of its target tokens)."""
    ids, labels = rows[f"{side}_input_ids"][i], rows[f"{side}_labels"][i]
    real = ids[: rows["prompt_length"][i] + (labels != IGNORE_INDEX).sum()]
    return tokenizer.decode(real), tokenizer.decode(ids[labels != IGNORE_INDEX])


def test_both_sides_share_the_prompt_tokens_and_train_only_on_the_answers(tokenizer):
    rows = tokenize_pairs([PAIR], tokenizer, 32)
    n = rows["prompt_length"][0]
    assert (rows["chosen_input_ids"][0, :n] == rows["rejected_input_ids"][0, :n]).all()
    for side in ("chosen", "rejected"):
        text, targets = _side(tokenizer, rows, side)
        assert text == tokenizer.apply_chat_template(USER + _answer(PAIR[side]), tokenize=False)
        assert targets == f"{PAIR[side]}<|im_end|>\n"
        assert (rows[f"{side}_labels"][0, :n] == IGNORE_INDEX).all()
    assert (rows["targets"][0], rows["truncated"][0]) == (3, 0)  # "five" / "six", <|im_end|>, newline


def test_the_three_record_formats_give_the_same_rows(tokenizer):
    chat = {"prompt": USER, "chosen": _answer("five"), "rejected": _answer("six")}
    whole = {"chosen": USER + _answer("five"), "rejected": USER + _answer("six")}
    formats = [detect_preference_format(r) for r in (PAIR, chat, whole)]
    assert formats == ["preference", "preference_chat", "preference_conversation"]
    rows = [tokenize_pairs([r], tokenizer, 32) for r in (PAIR, chat, whole)]
    for other in rows[1:]:
        assert all((other[k] == rows[0][k]).all() for k in rows[0])


def test_a_multi_turn_prompt_masks_its_own_assistant_turns(tokenizer):
    history = [{"role": "user", "content": "Write 4 in words."}, *_answer("four")]
    record = {"chosen": history + USER + _answer("five"), "rejected": history + USER + _answer("six")}
    text, targets = _side(tokenizer, tokenize_pairs([record], tokenizer, 64), "chosen")
    assert text == tokenizer.apply_chat_template(record["chosen"], tokenize=False)
    assert targets == "five<|im_end|>\n"


def test_truncation_keeps_the_prompts_end_and_the_answers_start_and_counts_what_it_drops():
    prompt, chosen, rejected = list(range(100, 120)), list(range(10)), list(range(20, 26))
    assert truncate_pair(prompt, chosen, rejected, 40) == (prompt, chosen, rejected, 0)
    # the prompt gives way first, down to the room the longer answer leaves
    assert truncate_pair(prompt, chosen, rejected, 26) == (prompt[-16:], chosen, rejected, 4)
    # never below half the row: then the answers lose their ends
    assert truncate_pair(prompt, chosen, rejected, 16) == (prompt[-8:], chosen[:8], rejected, 12 + 2)


def test_truncated_rows_fit_and_keep_a_target_on_both_sides(tokenizer):
    long = {"prompt": "Write 777 in words. " * 10, "chosen": "seven hundred seventy-seven " * 5, "rejected": "no"}
    rows = tokenize_pairs([long], tokenizer, 24)
    assert rows["chosen_input_ids"].shape == (1, 24) and rows["truncated"][0] > 0
    assert rows["chosen_labels"][0, -1] != IGNORE_INDEX  # the chosen answer fills the row
    text, _ = _side(tokenizer, rows, "rejected")
    assert text.endswith("<|im_start|>assistant\nno<|im_end|>\n")  # the prompt's end survived
    assert rows["targets"][0] > 0


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "chosen": "a"}, "'rejected' is missing"),
    ({"prompt": "p", "chosen": "a", "rejected": _answer("b")}, "must be all strings, or all lists"),
    ({"prompt": USER, "chosen": USER, "rejected": _answer("b")}, "chosen[0] has role 'user'"),
    ({"chosen": USER + _answer("a"), "rejected": _answer("b")}, "share no first message"),
    ({"chosen": USER + _answer("a"), "rejected": USER}, "'rejected' must continue"),
    ([1, 2], "expected a JSON object"),
])
def test_a_bad_record_is_named_in_one_line_and_marked_in_the_rows(tokenizer, record, message):
    with pytest.raises(ValueError) as e:
        detect_preference_format(record)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert tokenize_pairs([record, PAIR], tokenizer, 32)["targets"].tolist() == [-1, 3]


def test_without_a_chat_template_the_plain_template_bos_and_eos_are_used(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    prompt, chosen, rejected = tokenize_pair(plain, PAIR, "preference")
    assert plain.decode(prompt + chosen) == "<s>### Instruction:\nWrite 5 in words.\n\n### Response:\nfive<|im_end|>"
    assert plain.decode(rejected) == "six<|im_end|>"

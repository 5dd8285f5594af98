"""Preference pairs -> token rows, with the embedded tokenizer (a real BPE tokenizer with a chat template)."""

import copy

import pytest

from app.data.chat import IGNORE_INDEX
from app.data.pairs import detect_preference_format, tokenize_pair, tokenize_pairs, truncate_pair

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


def test_data_format_preference_routes_every_source_check_and_the_tokenizing_to_pairs(tokenizer, tmp_path):
    """What the pipeline calls for any source (formatting.tokenize_rows, sources.checked_records) reads pairs when
    data.format=preference: a JSONL of pairs counts its records, a bad one is named by file and line, and a
    Parquet file needs chosen and rejected columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.formatting import detect_format, tokenize_rows
    from app.data.sources import checked_records, resolve_source
    from app.errors import UserInputError

    rows = tokenize_rows([PAIR, {"prompt": "x"}], tokenizer, "preference", 32)
    assert list(rows["targets"] > 0) == [True, False] and rows["targets"][1] == -1
    assert rows["length"][0] == 2 * rows["prompt_length"][0] + sum(
        (rows[f"{side}_labels"][0] != IGNORE_INDEX).sum() for side in ("chosen", "rejected"))
    assert detect_format(PAIR, "preference") == "preference"
    good = tmp_path / "pairs.jsonl"
    good.write_text("".join(f'{{"prompt": "p{i}", "chosen": "a", "rejected": "b"}}\n' for i in range(3)))
    assert checked_records(resolve_source(str(good), "data.train_path"), "preference") == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"}\n')
    with pytest.raises(UserInputError, match=r"bad.jsonl:2: a preference record needs .*'rejected' is missing"):
        checked_records(resolve_source(str(bad), "data.train_path"), "preference")
    pq.write_table(pa.table({"prompt": ["p"], "completion": ["c"]}), tmp_path / "sft.parquet")
    with pytest.raises(UserInputError, match=r"lack the fields chosen\+rejected"):
        checked_records(resolve_source(str(tmp_path / "sft.parquet"), "data.train_path"), "preference")


def test_a_stand_in_pair_trains_and_counts_nothing():
    """A resumed rank whose first batch is already trained gets its last row with no target (app/data/stream.py):
    for pairs, both sides' labels are ignored, so it is not a pair (app/train/preference.py's real_pairs)."""
    import torch

    from app.data.stream import without_targets
    from app.train.dpo import real_pairs

    columns = [f"{side}_{c}" for side in ("chosen", "rejected") for c in ("input_ids", "labels")]
    batch = {column: torch.arange(8).reshape(2, 4) for column in columns}
    batch["length"] = torch.tensor([4, 4])
    stand_in = without_targets(batch)
    assert real_pairs(batch).tolist() == [True, True] and real_pairs(stand_in).tolist() == [False]
    assert (stand_in["rejected_labels"] == IGNORE_INDEX).all()
    assert stand_in["chosen_input_ids"].tolist() == [[4, 5, 6, 7]]
    assert stand_in["length"].tolist() == [0]

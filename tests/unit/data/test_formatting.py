"""Formatting and label masking with the embedded tokenizer (a real BPE tokenizer with a chat template)."""

import copy

import numpy as np
import pytest

from app.config.sections import ModelSection
from app.data.chat import IGNORE_INDEX
from app.data.conversations import tokenize_record
from app.data.formatting import check_chat_template, detect_format, tokenize_rows
from app.errors import UserInputError
from app.model.base import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(embedded):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded["model"])


def _targets(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])


def test_chat_records_train_only_on_assistant_turns(tokenizer):
    record = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Write 12 in words."},
                           {"role": "assistant", "content": "twelve"},
                           {"role": "user", "content": "And 13?"},
                           {"role": "assistant", "content": "thirteen"}]}
    ids, labels = tokenize_record(tokenizer, record, "chat", 256)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert _targets(tokenizer, ids, labels) == "twelve<|im_end|>\nthirteen<|im_end|>\n"


def test_instruction_and_prompt_completion_use_the_chat_template(tokenizer):
    inst = tokenize_record(tokenizer, {"instruction": "Write 5 in words.", "output": "five"}, "instruction", 256)
    pc = tokenize_record(tokenizer, {"prompt": "Write 5 in words.", "completion": "five"}, "prompt_completion", 256)
    assert inst == pc
    assert _targets(tokenizer, *inst) == "five<|im_end|>\n"


def test_without_a_chat_template_a_plain_template_and_eos_are_used(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    ids, labels = tokenize_record(plain, {"instruction": "Write 5 in words.", "input": "", "output": "five"},
                                  "instruction", 256)
    assert plain.decode(ids).startswith("<s>### Instruction:\nWrite 5 in words.\n\n### Response:\n")
    assert _targets(plain, ids, labels) == "five<|im_end|>"  # the eos is learned too


def test_rows_are_padded_and_truncated_to_max_seq_len(tokenizer):
    records = [{"prompt": "Write 5 in words.", "completion": "five"},
               {"prompt": "Write 777 in words.", "completion": "seven hundred seventy-seven " * 10}]
    rows = tokenize_rows(records, tokenizer, "auto", max_seq_len=24)
    assert rows["input_ids"].shape == rows["labels"].shape == (2, 24)
    assert rows["input_ids"][0, -1] == tokenizer.pad_token_id and rows["labels"][0, -1] == IGNORE_INDEX
    assert (rows["input_ids"][1] != tokenizer.pad_token_id).all() and rows["labels"][1, -1] != IGNORE_INDEX


@pytest.mark.parametrize("record, message", [
    ({"body": "hi"}, "record needs fields messages or conversations or instruction+output or prompt+completion or "
                     "text (has: body)"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "user"}]}, "messages[0] needs string fields 'role' and 'content'"),
    ({"instruction": "a", "output": "b", "input": 3}, "field 'input' must be a string"),
    ([1, 2], "expected a JSON object, got list"),
])
def test_records_without_the_needed_fields_are_rejected(record, message):
    with pytest.raises(ValueError) as e:
        detect_format(record)
    assert message in str(e.value)


def test_a_forced_format_only_accepts_that_format():
    assert detect_format({"prompt": "a", "completion": "b"}) == "prompt_completion"
    with pytest.raises(ValueError, match="needs fields messages"):
        detect_format({"prompt": "a", "completion": "b"}, "chat")


def test_sharegpt_conversations_train_on_the_gpt_turns(tokenizer):
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Write 12."},
                                  {"from": "gpt", "value": "twelve"}]}
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write 12."},
                         {"role": "assistant", "content": "twelve"}]}
    assert detect_format(sharegpt) == "sharegpt"
    assert tokenize_record(tokenizer, sharegpt, "sharegpt", 64) == tokenize_record(tokenizer, chat, "chat", 64)


def test_plain_text_trains_on_every_token(tokenizer):
    ids, labels = tokenize_record(tokenizer, {"text": "347 is written three hundred forty-seven."}, "text", 64)
    assert ids == labels and ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "347 is written three hundred forty-seven."
    one, _ = tokenize_record(tokenizer, {"text": "one"}, "text", 16)
    assert tokenize_rows([{"text": "one"}], tokenizer, "auto", 16)["targets"].tolist() == [len(one) - 1]


def test_a_config_chat_template_replaces_the_tokenizers_own(embedded):
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    tokenizer = load_tokenizer(ModelSection(path=str(embedded["model"])), template)
    ids, labels = tokenize_record(tokenizer, {"prompt": "Write 5.", "completion": "five"}, "prompt_completion", 64)
    assert tokenizer.decode(ids) == "[user] Write 5.\n[assistant] five\n"
    assert tokenizer.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == "five\n"
    broken = load_tokenizer(ModelSection(path=str(embedded["model"])), "{% for m in messages %}{{ m.nope() }}")
    with pytest.raises(UserInputError, match="data.chat_template: its chat template cannot render"):
        check_chat_template(broken, "data.chat_template")


def test_records_without_their_fields_are_marked_for_dropping_not_fatal(tokenizer):
    """Only data the driver could not check whole (remote, past its sample) can hold them."""
    rows = tokenize_rows([{"prompt": "Write 5.", "completion": "five"}, {"question": "?"}], tokenizer, "auto", 32)
    assert rows["targets"][0] > 0 and rows["targets"][1] == -1


def test_a_long_record_is_truncated_or_split_into_rows(tokenizer):
    text = {"text": " ".join(["three hundred forty-seven"] * 12)}
    whole, _ = tokenize_record(tokenizer, text, "text", None)
    truncated = tokenize_rows([text, {"text": "one"}], tokenizer, "auto", 16)
    split = tokenize_rows([text, {"text": "one"}], tokenizer, "auto", 16, long_records="split")
    assert truncated["length"].tolist()[0] == 16 and len(truncated["length"]) == 2
    pieces = -(-len(whole) // 16)
    assert len(split["length"]) == pieces + 1 and split["length"][:pieces].sum() == len(whole)
    rejoined = np.concatenate([split["input_ids"][i, :n] for i, n in enumerate(split["length"][:pieces])])
    assert rejoined.tolist() == whole  # every token is in a row, in order

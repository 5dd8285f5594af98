"""Preference pairs -> token rows for DPO: a prompt with a chosen and a rejected answer.

Record formats (detected per record):
  preference               {"prompt": str, "chosen": str, "rejected": str}
  preference_chat          {"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}
  preference_conversation  {"chosen": [messages], "rejected": [messages]}: whole conversations; the prompt is
                           the messages they share from the start (UltraFeedback-style sets)
Both sides are rendered with the tokenizer's chat template (or the plain prompt, app/data/chat.py, for a
tokenizer without one); the prompt is tokenized once, so chosen and rejected share its tokens exactly, and
only the answers' tokens are targets.
"""

from __future__ import annotations

import functools

import numpy as np
from jinja2 import TemplateError

from app.data.chat import IGNORE_INDEX, check_messages, pad_id, plain_prompt

PREFERENCE_FORMATS = ("preference", "preference_chat", "preference_conversation")


def detect_preference_format(record) -> str:
    """The record's preference format, or ValueError naming the field that is missing or wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for side in ("chosen", "rejected"):
        if not isinstance(record.get(side), (str, list)):
            raise ValueError(f"a preference record needs fields prompt (optional with whole conversations), chosen "
                             f"and rejected; '{side}' is missing or not a string or list of messages")
    prompt = record.get("prompt")
    if all(isinstance(record.get(f), str) for f in ("prompt", "chosen", "rejected")):
        return "preference"
    if isinstance(prompt, list):
        check_messages(prompt, "prompt")
        for side in ("chosen", "rejected"):
            check_messages(record[side], side, only="assistant")
        return "preference_chat"
    if prompt is None:
        split_conversations(record["chosen"], record["rejected"])
        return "preference_conversation"
    raise ValueError("'prompt', 'chosen' and 'rejected' must be all strings, or all lists of messages")


def split_conversations(chosen, rejected) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen answer, rejected answer) of two whole conversations: the prompt is the messages they
    share from the start; each answer must then be assistant messages."""
    check_messages(chosen, "chosen")
    check_messages(rejected, "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    prompt, answers = chosen[:shared], (chosen[shared:], rejected[shared:])
    if not prompt:
        raise ValueError("'chosen' and 'rejected' share no first message: give the prompt as 'prompt'")
    for side, answer in zip(("chosen", "rejected"), answers):
        if not answer or any(m["role"] != "assistant" for m in answer):
            raise ValueError(f"'{side}' must continue the messages both conversations share with assistant "
                             "messages only")
    return prompt, *answers


def pair_messages(record: dict, fmt: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) as message lists."""
    if fmt == "preference_conversation":
        return split_conversations(record["chosen"], record["rejected"])
    if fmt == "preference_chat":
        return record["prompt"], record["chosen"], record["rejected"]
    return ([{"role": "user", "content": record["prompt"]}],
            *([{"role": "assistant", "content": record[side]}] for side in ("chosen", "rejected")))


def _texts(tokenizer, prompt: list[dict], answer: list[dict]) -> tuple[str, str]:
    """The prompt as the model sees it before it answers, and the answer's text after it."""
    if not tokenizer.chat_template:
        return plain_prompt(prompt), "".join(m["content"] for m in answer)
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    before, full = render(prompt, add_generation_prompt=True), render(prompt + answer)
    if not full.startswith(before):
        raise ValueError("the tokenizer's chat template does not render the answer after the prompt as it renders "
                         "the prompt alone; give the tokenizer another chat_template")
    return before, full[len(before):]


def tokenize_pair(tokenizer, record: dict, fmt: str) -> tuple[list[int], list[int], list[int]]:
    """Token ids of (prompt, chosen answer, rejected answer), untruncated."""
    prompt, *answers = pair_messages(record, fmt)
    plain = not tokenizer.chat_template
    encode = functools.partial(tokenizer, add_special_tokens=False)
    sides = [_texts(tokenizer, prompt, answer) for answer in answers]
    prompt_ids = encode(sides[0][0])["input_ids"]
    if plain and tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    eos = [tokenizer.eos_token_id] if plain and tokenizer.eos_token_id is not None else []
    return prompt_ids, *(encode(answer)["input_ids"] + eos for _, answer in sides)


def truncate_pair(prompt: list[int], chosen: list[int], rejected: list[int], max_len: int):
    """(prompt, chosen, rejected, tokens dropped) so that the prompt with either answer fits in max_len:
    the prompt loses its start (what comes right before the answer matters most) but keeps at least half of
    max_len (or all of itself if shorter), then the answers lose their ends."""
    longest = max(len(chosen), len(rejected))
    keep_prompt = min(len(prompt), max(max_len - longest, max_len // 2))
    keep_answer = max_len - keep_prompt
    dropped = len(prompt) - keep_prompt + max(len(chosen) - keep_answer, 0) + max(len(rejected) - keep_answer, 0)
    return prompt[len(prompt) - keep_prompt:], chosen[:keep_answer], rejected[:keep_answer], dropped


def tokenize_pairs(records: list[dict], tokenizer, max_seq_len: int) -> dict[str, np.ndarray]:
    """Records -> fixed-length rows: `chosen_input_ids`/`rejected_input_ids` (prompt + answer, padded with
    the pad id), `chosen_labels`/`rejected_labels` (the answer's tokens; -100 on the prompt and padding),
    `prompt_length`, `length` (the real tokens of both sides: what a step computes), `truncated` (tokens
    truncation dropped from the pair) and `targets`: the fewer target tokens of the two sides (-1 for a
    record without the fields its format needs)."""
    n = len(records)
    rows = {f"{side}_{column}": np.full((n, max_seq_len), fill, dtype=np.int64)
            for side in ("chosen", "rejected")
            for column, fill in (("input_ids", pad_id(tokenizer)), ("labels", IGNORE_INDEX))}
    rows |= {column: np.zeros(n, dtype=np.int64) for column in ("prompt_length", "length", "truncated", "targets")}
    for i, record in enumerate(records):
        try:
            prompt, *answers, dropped = truncate_pair(*tokenize_pair(tokenizer, record,
                                                                     detect_preference_format(record)), max_seq_len)
        except (ValueError, TemplateError):  # the chat template refuses a record's roles or order
            rows["targets"][i] = -1
            continue
        rows["prompt_length"][i], rows["truncated"][i] = len(prompt), dropped
        rows["targets"][i] = min(len(answer) for answer in answers)
        rows["length"][i] = 2 * len(prompt) + sum(len(answer) for answer in answers)
        for side, answer in zip(("chosen", "rejected"), answers):
            length = len(prompt) + len(answer)
            rows[f"{side}_input_ids"][i, :length] = prompt + answer
            rows[f"{side}_labels"][i, len(prompt):length] = answer
    return rows

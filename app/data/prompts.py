"""Prompts for online RL (train.objective=grpo) -> token rows: the prompt's ids, and the whole record, which the
reward functions read (its `prompt` as given, and every other field as a keyword argument: an `answer`, tests
to run, ...).

Formats (detected per record, data.format=prompt):
  plain           {"prompt": str, ...}: tokenized as it is, as TRL does with a plain-text prompt
  conversational  {"prompt": [messages], ...}: rendered with the tokenizer's chat template, the assistant's turn
                  opened (its answers then reach the reward functions as [{"role": "assistant", "content": ...}])
A prompt longer than data.max_seq_len keeps its end (what comes right before the answer matters most).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from jinja2 import TemplateError

from app.data.chat import check_messages, pad_id

PROMPT_FIELDS = ("prompt",)


def detect_prompt_format(record: Any) -> str:
    """"prompt" (plain) or "prompt_chat" (messages), or ValueError naming what is missing or wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("'prompt' is empty")
        return "prompt"
    if isinstance(prompt, list):
        check_messages(prompt, "prompt")
        if prompt[-1]["role"] == "assistant":
            raise ValueError("'prompt' ends with an assistant message: the answer is what the policy samples")
        return "prompt_chat"
    raise ValueError(f"a prompt record needs a field 'prompt' (a string or a list of messages) (has: "
                     f"{', '.join(sorted(record)) or 'none'})")


def prompt_ids(tokenizer, record: dict) -> list[int]:
    """The prompt's token ids, as the policy is asked: the chat template's rendering of messages with the
    assistant's turn opened, or the plain text with the tokenizer's own special tokens."""
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not tokenizer.chat_template:
        raise ValueError("a conversational prompt needs a chat template (the tokenizer has none; set "
                         "data.chat_template)")
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]


def is_conversational(record: dict) -> bool:
    return isinstance(record.get("prompt"), list)


def tokenize_prompts(records: list[dict], tokenizer, max_seq_len: int) -> dict[str, np.ndarray]:
    """Records -> rows: `prompt_input_ids` (right-padded to max_seq_len with the pad id), `prompt_length`,
    `length` (the same: the real tokens), `truncated` (prompt tokens cut from the start), `is_prompt` (1; a
    stand-in row that trains nothing has 0), `record` (the record as JSON, for the reward functions) and
    `targets` (1, or -1 for a record without its fields)."""
    n = len(records)
    rows = {"prompt_input_ids": np.full((n, max_seq_len), pad_id(tokenizer), dtype=np.int64)}
    rows |= {column: np.zeros(n, dtype=np.int64) for column in ("prompt_length", "truncated", "targets")}
    texts: list[str] = []
    for i, record in enumerate(records):
        try:
            detect_prompt_format(record)
            ids = prompt_ids(tokenizer, record)
        except (ValueError, TemplateError):  # the chat template refuses a record's roles or order
            rows["targets"][i] = -1
            texts.append("{}")
            continue
        kept = ids[-max_seq_len:]
        rows["prompt_input_ids"][i, :len(kept)] = kept
        rows["prompt_length"][i], rows["truncated"][i], rows["targets"][i] = len(kept), len(ids) - len(kept), 1
        texts.append(json.dumps(record, default=str))
    rows["length"] = rows["prompt_length"].copy()
    rows["is_prompt"] = (rows["targets"] > 0).astype(np.int64)
    rows["record"] = np.array(texts, dtype=object)
    return rows

"""Records -> token rows, by `data.format`: which fields each format needs, which format a record has, and its
token rows (app/data/conversations.py for records with an answer to learn; app/data/pairs.py for preference
pairs, data.format=preference, which train.objective=dpo sets; app/data/prompts.py for prompts alone,
data.format=prompt, which train.objective=grpo sets). Checked in the driver (app/data/sources.py) and
tokenized by Ray Data (app/data/pipeline.py) with the same functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.data.conversations import (
    FORMAT_FIELDS,
    detect_conversation_format,
    prompt_and_target_segments,
    tokenize_conversations,
)
from app.data.pairs import detect_preference_format, tokenize_pairs
from app.data.prompts import PROMPT_FIELDS, detect_prompt_format, tokenize_prompts
from app.errors import UserInputError, first_line

PREFERENCE = "preference"  # data.format of preference pairs: never auto-detected, train.objective=dpo sets it
PROMPT = "prompt"  # data.format of prompts alone: never auto-detected, train.objective=grpo sets it


def required_fields(fmt: str) -> dict[str, tuple[str, ...]]:
    """The fields (columns) a record of `fmt` has, by format: any of them for `auto`."""
    if fmt == PREFERENCE:
        return {fmt: ("chosen", "rejected")}
    if fmt == PROMPT:
        return {fmt: PROMPT_FIELDS}
    return FORMAT_FIELDS if fmt == "auto" else {fmt: FORMAT_FIELDS[fmt]}


def detect_format(record: Any, wanted: str = "auto") -> str:
    """The record's format, or ValueError saying which fields are missing or wrong."""
    if wanted == PREFERENCE:
        return detect_preference_format(record)
    if wanted == PROMPT:
        return detect_prompt_format(record)
    return detect_conversation_format(record, wanted)


def tokenize_rows(records: list[dict], tokenizer, fmt: str, max_seq_len: int,
                  long_records: str = "truncate") -> dict[str, np.ndarray]:
    """Records -> fixed-length token rows with their `targets` count (-1: a record without its fields)."""
    if fmt == PREFERENCE:
        return tokenize_pairs(records, tokenizer, max_seq_len)
    if fmt == PROMPT:
        return tokenize_prompts(records, tokenizer, max_seq_len)
    return tokenize_conversations(records, tokenizer, fmt, max_seq_len, long_records)


def check_chat_template(tokenizer, where: str) -> None:
    """A chat template that cannot render a plain conversation fails here, in the driver, not in a worker."""
    if not tokenizer.chat_template:
        return
    conversation = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."}]
    try:
        prompt_and_target_segments(tokenizer, conversation)
    except Exception as e:  # jinja2's errors, or ours for a template that does not render prefix by prefix
        raise UserInputError(f"{where}: its chat template cannot render a user/assistant conversation: "
                             f"{first_line(e)}") from None

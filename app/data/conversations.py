"""Records with an answer to learn -> token rows whose labels are the answer's tokens only.

Formats (one per record; `data.format=auto` detects it):
  chat               {"messages": [{"role": "user"|"system"|"assistant", "content": str}, ...]}
  sharegpt           {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}
  instruction        {"instruction": str, "input": str (optional), "output": str}   (Alpaca)
  prompt_completion  {"prompt": str, "completion": str}
  text               {"text": str}   (continued pretraining: every token carries loss)
In the conversational formats only assistant / gpt / output / completion tokens are trained on;
everything else gets label -100. Plain functions on plain Python data: Ray Data's `map_batches` calls
them on workers, and tests and the adapter-reload check call them directly.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from jinja2 import TemplateError

from app.data.chat import IGNORE_INDEX, check_messages, pad_id, plain_prompt

FORMAT_FIELDS = {"chat": ("messages",), "sharegpt": ("conversations",), "instruction": ("instruction", "output"),
                 "prompt_completion": ("prompt", "completion"), "text": ("text",)}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def detect_conversation_format(record: Any, wanted: str = "auto") -> str:
    """The record's format (`wanted`, or any with `auto`), or ValueError saying which fields are missing."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    candidates = FORMAT_FIELDS if wanted == "auto" else {wanted: FORMAT_FIELDS[wanted]}
    for name, fields in candidates.items():
        if all(isinstance(record.get(f), (str, list)) for f in fields):
            _check_fields(record, name)
            return name
    expected = " or ".join("+".join(f) for f in candidates.values())
    raise ValueError(f"record needs fields {expected} (has: {', '.join(sorted(record)) or 'none'})")


def _check_fields(record: dict, fmt: str) -> None:
    if fmt in ("chat", "sharegpt"):
        messages = as_messages(record, fmt)
        check_messages(messages, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("'messages' has no assistant turn to learn from")
        return
    for f in FORMAT_FIELDS[fmt] + (("input",) if fmt == "instruction" else ()):
        if f in record and not isinstance(record[f], str):
            raise ValueError(f"field '{f}' must be a string")


def as_messages(record: dict, fmt: str) -> list[dict]:
    if fmt == "chat":
        return record["messages"]
    if fmt == "sharegpt":
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("'conversations' must be a non-empty list")
        messages = []
        for i, turn in enumerate(turns):
            if not (isinstance(turn, dict) and all(isinstance(turn.get(k), str) for k in ("from", "value"))):
                raise ValueError(f"conversations[{i}] needs string fields 'from' and 'value'")
            if turn["from"] not in SHAREGPT_ROLES:
                raise ValueError(f"conversations[{i}]: 'from' is {turn['from']!r}; expected one of "
                                 f"{', '.join(SHAREGPT_ROLES)}")
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
        return messages
    if fmt == "instruction":
        user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def prompt_and_target_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """Split a conversation into (text, is_target) pieces whose concatenation is the rendered text.

    With a chat template each assistant turn is a target; the text before it (rendered with
    `add_generation_prompt=True`) is context. Without one, the plain instruction prompt is used.
    """
    if not tokenizer.chat_template:
        *context, last = messages
        return [(plain_prompt(context), False), (last["content"], True)]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], add_generation_prompt=True) if i else ""
        full = render(messages[: i + 1])
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ValueError("the tokenizer's chat template does not render conversations prefix by prefix; "
                             "set data.format=instruction or give the tokenizer another chat_template")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    return segments


def tokenize_text(tokenizer, text: str, max_seq_len: int | None) -> tuple[list[int], list[int]]:
    """Plain text: the tokenizer's own special tokens around it, every token a target."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return ids[:max_seq_len], ids[:max_seq_len]


def tokenize_record(tokenizer, record: dict, fmt: str, max_seq_len: int | None) -> tuple[list[int], list[int]]:
    """input_ids and labels (prompt tokens masked), truncated to max_seq_len (None: whole), unpadded."""
    if fmt == "text":
        return tokenize_text(tokenizer, record["text"], max_seq_len)
    segments = prompt_and_target_segments(tokenizer, as_messages(record, fmt))
    ids: list[int] = []
    labels: list[int] = []
    if not tokenizer.chat_template and tokenizer.bos_token_id is not None:
        ids, labels = [tokenizer.bos_token_id], [IGNORE_INDEX]
    for text, is_target in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if is_target else [IGNORE_INDEX] * len(piece)
    if not tokenizer.chat_template and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    return ids[:max_seq_len], labels[:max_seq_len]


def tokenize_conversations(records: list[dict], tokenizer, fmt: str, max_seq_len: int,
                           long_records: str = "truncate") -> dict[str, np.ndarray]:
    """Records -> fixed-length rows: input_ids padded with the pad id, labels padded with -100, `length`
    (tokens before padding) and `targets`, each row's number of tokens that carry loss (0 when truncation
    cut every target off; -1 for a record without the fields its format needs, which only data the driver
    could not check holds). A record longer than max_seq_len is truncated, or with long_records="split"
    cut into rows of max_seq_len (each piece then starts without the context before it).

    Right padding needs no attention mask: under the causal mask a real token never attends to a
    later pad, and pads carry no loss.
    """
    pieces: list[tuple[list[int], list[int]] | None] = []
    for record in records:
        try:
            ids, labs = tokenize_record(tokenizer, record, detect_conversation_format(record, fmt),
                                        None if long_records == "split" else max_seq_len)
        except (ValueError, TemplateError):  # the chat template refuses a record's roles or order
            pieces.append(None)
            continue
        pieces += [(ids[i:i + max_seq_len], labs[i:i + max_seq_len]) for i in range(0, max(len(ids), 1), max_seq_len)]
    input_ids = np.full((len(pieces), max_seq_len), pad_id(tokenizer), dtype=np.int64)
    labels = np.full((len(pieces), max_seq_len), IGNORE_INDEX, dtype=np.int64)
    length = np.zeros(len(pieces), dtype=np.int64)
    for row, piece in enumerate(pieces):
        if piece is not None:
            length[row] = len(piece[0])
            input_ids[row, : length[row]], labels[row, : length[row]] = piece
    targets = (labels[:, 1:] != IGNORE_INDEX).sum(axis=1)  # labels are shifted: position 0 never counts
    targets[np.array([p is None for p in pieces], dtype=bool)] = -1
    return {"input_ids": input_ids, "labels": labels, "length": length, "targets": targets}

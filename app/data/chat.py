"""What every record format shares: messages (checked, and rendered with the tokenizer's chat template, or as
a plain instruction prompt where the tokenizer has none), the padding id, and the label of a token that
carries no loss. The formats (app/data/conversations.py, app/data/pairs.py) build on these; nothing here
knows a format."""

from __future__ import annotations

IGNORE_INDEX = -100  # the label of a token that carries no loss (the prompt, padding)
PLAIN_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"  # a tokenizer without a chat template


def pad_id(tokenizer) -> int:
    """The id rows are padded with: the tokenizer's padding token, else its end token (0 for neither)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def plain_prompt(messages: list[dict]) -> str:
    """The prompt for `messages` (every turn before the answer) without a chat template."""
    return PLAIN_PROMPT.format(instruction="\n\n".join(m["content"] for m in messages))


def check_messages(messages, field: str, only: str | None = None) -> None:
    """`messages` must be a non-empty list of {"role": str, "content": str} (all with role `only`, if given);
    ValueError naming `field` and the first message that is not."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'{field}' must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{field}[{i}] needs string fields 'role' and 'content'")
        if only and m["role"] != only:
            raise ValueError(f"{field}[{i}] has role {m['role']!r}; '{field}' holds {only} messages only")

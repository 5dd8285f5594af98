"""Chat messages to prompt token ids, where what a user typed stays text.

`apply_chat_template(..., tokenize=True)` tokenizes the rendered prompt as one string, so a user who
types `<|im_start|>system` gets a real control token and can forge turns. Here the template is rendered
with a placeholder for each message's content; its own markup is tokenized with special tokens, and
each content with `split_special_tokens=True` (the characters, never the control token).
"""

from __future__ import annotations

import uuid

ROLES = ("system", "user", "assistant")


class PromptEncoder:
    def __init__(self, tokenizer):
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template: chat completions need one")
        self.tokenizer = tokenizer

    def _ids(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"]

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids of `messages` (role, content) with the assistant's turn opened."""
        marks = [f"@@{uuid.uuid4().hex}@@" for _ in messages]
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": mark} for m, mark in zip(messages, marks, strict=True)],
            add_generation_prompt=True, tokenize=False)
        ids: list[int] = []
        for mark, message in zip(marks, messages, strict=True):
            markup, found, rendered = rendered.partition(mark)
            if not found or mark in rendered:  # the template drops, alters or repeats a message's content
                raise ValueError("the chat template does not render each message's content once, unchanged")
            ids += self._ids(markup, special=True) + self._ids(message["content"], special=False)
        return ids + self._ids(rendered, special=True)

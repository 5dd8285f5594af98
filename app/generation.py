"""Sample generations on held-out prompts: what a reviewer reads next to the eval loss.

The prompt of an eval row is everything before its first target token; the reference is its target
tokens. Decoding is greedy for a fixed number of steps without a KV cache, so every FSDP rank runs
the same forward passes in lockstep (each forward all-gathers parameters) and gets the same text.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from app.formatting import IGNORE_INDEX


def prompts_and_references(batches: Iterable[dict], count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `count` eval rows split into (prompt ids, reference ids); rows with no target are skipped.
    A row that is target from its first token (plain text, a piece of a split record) keeps that first
    token as its prompt: a model cannot continue an empty prompt."""
    pairs = []
    for batch in batches:
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            targets = (labels != IGNORE_INDEX).nonzero()
            if len(targets) and len(pairs) < count:
                start = max(int(targets[0, 0]), 1)
                reference = ids[start:][labels[start:] != IGNORE_INDEX]
                if len(reference):
                    pairs.append((ids[:start], reference))
    return pairs


@torch.no_grad()
def greedy_continuation(model, prompt: torch.Tensor, max_new_tokens: int, eos_id: int | None) -> torch.Tensor:
    """The argmax continuation of one prompt, cut after the first end-of-sequence token.

    Always runs `max_new_tokens` forward passes, so ranks sharing a sharded model never diverge.
    """
    ids = prompt.unsqueeze(0)
    for _ in range(max_new_tokens):
        next_id = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
    new = ids[0, prompt.numel():]
    if eos_id is not None and (new == eos_id).any():
        new = new[: int((new == eos_id).nonzero()[0, 0]) + 1]
    return new


def sample_generations(model, batches: Iterable[dict], tokenizer, count: int, max_new_tokens: int,
                       device: torch.device) -> dict[str, list[str]]:
    """A table (column -> values) of prompt, reference and generated text for `count` eval rows."""
    was_training = model.training
    model.eval()
    table: dict[str, list[str]] = {"prompt": [], "reference": [], "generated": []}
    for prompt, reference in prompts_and_references(batches, count):
        generated = greedy_continuation(model, prompt.to(device), max_new_tokens, tokenizer.eos_token_id)
        table["prompt"].append(tokenizer.decode(prompt, skip_special_tokens=True))
        table["reference"].append(tokenizer.decode(reference, skip_special_tokens=True))
        table["generated"].append(tokenizer.decode(generated, skip_special_tokens=True))
    model.train(was_training)
    return table

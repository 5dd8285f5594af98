"""Greedy generations on held-out prompts: the sample table and the task metrics (app/train/task_metrics.py).

The prompt of an eval row is everything before its first target token; the reference is its target
tokens. The prompts are dealt to the ranks, each rank decodes its share as one left-padded batch, and
the texts are gathered. Decoding runs without a KV cache and every rank runs a forward at every decoding
step until every rank's rows have ended (FSDP all-gathers parameters in each forward, so the ranks
must stay in lockstep); a rank with no prompt left decodes a stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from app.data.formatting import IGNORE_INDEX


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
def greedy_batch(model, prompts: list[torch.Tensor], max_new_tokens: int, eos_id: int | None, pad_id: int,
                 device: torch.device, everyone_done: Callable[[bool], bool] = bool) -> list[torch.Tensor]:
    """The argmax continuations of several prompts at once (left-padded; position ids count real tokens
    only), each cut after its first end-of-sequence token. `everyone_done(mine)` says whether every rank's
    rows have ended: the loop stops only then."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt.to(device), 1
    ended = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    new: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        next_id = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].argmax(-1)
        next_id = torch.where(ended, pad_id, next_id)
        new.append(next_id)
        ids, mask = torch.cat([ids, next_id[:, None]], 1), torch.cat([mask, (~ended)[:, None].long()], 1)
        if eos_id is not None:
            ended |= next_id == eos_id
        if everyone_done(bool(ended.all())):
            break
    out = torch.stack(new, 1).cpu() if new else torch.zeros(len(prompts), 0, dtype=torch.long)
    continuations = []
    for row, done in zip(out, ended.cpu()):
        cut = int((row == eos_id).nonzero()[0, 0]) + 1 if done else len(row)
        continuations.append(row[:cut])
    return continuations


def _all_ranks_done(mine: bool, device: torch.device) -> bool:
    flag = torch.tensor([float(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def generation_table(model, batches: Iterable[dict], tokenizer, count: int, max_new_tokens: int,
                     device: torch.device) -> dict[str, list[str]]:
    """A table (column -> values) of prompt, reference and generated text for up to `count` eval rows,
    the same on every rank (the rows are decoded across the ranks of the default process group)."""
    pairs = prompts_and_references(batches, count)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(pairs), world))
    prompts = [pairs[i][0] for i in mine] or [pairs[0][0] if pairs else torch.tensor([tokenizer.eos_token_id or 0])]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    was_training = model.training
    model.eval()
    texts = greedy_batch(model, prompts, max_new_tokens, tokenizer.eos_token_id, pad_id, device,
                         lambda mine_done: _all_ranks_done(mine_done, device))
    model.train(was_training)
    decoded = {i: tokenizer.decode(t, skip_special_tokens=True) for i, t in zip(mine, texts)}
    gathered: list[dict[int, str] | None] = [None] * world
    dist.all_gather_object(gathered, decoded)
    generated = {i: text for part in gathered for i, text in part.items()}
    return {"prompt": [tokenizer.decode(p, skip_special_tokens=True) for p, _ in pairs],
            "reference": [tokenizer.decode(r, skip_special_tokens=True) for _, r in pairs],
            "generated": [generated[i] for i in range(len(pairs))]}

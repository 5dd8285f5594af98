"""Greedy generations on held-out prompts: the sample table and the task metrics (app/train/task_metrics.py).

Each assistant turn of an eval row (a run of target tokens, app/data/formatting.py) is one prompt: the
conversation up to the turn is the prompt, the turn's target tokens its reference. The prompts are dealt to
the ranks, each rank decodes its share as one left-padded batch, and the texts are gathered. An answer ends
at any of the model's end tokens (its generation config's eos ids besides the tokenizer's: Gemma ends a turn
with <end_of_turn>, Llama 3 with <|eot_id|>). Decoding keeps a KV cache (each step feeds one token, not the
whole row) and every rank runs a forward at every decoding step until every rank's rows have ended (FSDP
all-gathers parameters in each forward, so the ranks must stay in lockstep); a rank with no prompt left
decodes a stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from app.data.chat import IGNORE_INDEX
from app.engine.sequence import end_token_ids
from app.errors import warn_once
from app.train.host_memory import release_free_host_memory


def target_runs(labels: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of target labels in a row: one assistant turn each."""
    is_target = (labels != IGNORE_INDEX).int()
    zero = is_target.new_zeros(1)
    edges = torch.diff(is_target, prepend=zero, append=zero).nonzero()[:, 0].tolist()
    return list(zip(edges[0::2], edges[1::2]))


def prompts_and_references(batches: Iterable[dict], count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `count` assistant turns of the eval rows as (prompt ids, reference ids): the row up to the
    turn, and the turn's target tokens. A row that is target from its first token (plain text, a piece of a
    split record) keeps that first token as its prompt: a model cannot continue an empty prompt."""
    pairs = []
    for batch in batches:
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            for start, end in target_runs(labels):
                start = max(start, 1)
                if start < end:
                    pairs.append((ids[:start], ids[start:end]))
                if len(pairs) == count:
                    return pairs
    return pairs


@torch.no_grad()
def greedy_batch(model, prompts: list[torch.Tensor], max_new_tokens: int, end_ids: list[int], pad_id: int,
                 device: torch.device, everyone_done: Callable[[bool], bool] = bool) -> list[torch.Tensor]:
    """The argmax continuations of several prompts at once (left-padded; position ids count real tokens
    only; the KV cache keeps each step to one new token), each cut after its first token of `end_ids`.
    `everyone_done(mine)` says whether every rank's rows have ended: the loop stops only then. Eager even where
    the layers are compiled (model.compile): a growing width per token would recompile them past dynamo's limit
    for a few tokens' gain."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt.to(device), 1
    ends = torch.tensor(end_ids, dtype=torch.long, device=device)
    ended = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    new: list[torch.Tensor] = []
    cache, fed = None, 0  # the keys and values of the tokens fed so far: each later step feeds one token
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.compiler.set_stance("force_eager"):
            out = model(input_ids=ids[:, fed:], attention_mask=mask, position_ids=positions[:, fed:],
                        past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        fed = ids.shape[1] if cache is not None else 0  # a model that keeps no cache is fed the whole row again
        next_id = out.logits[:, -1].argmax(-1)
        next_id = torch.where(ended, pad_id, next_id)
        new.append(next_id)
        ids, mask = torch.cat([ids, next_id[:, None]], 1), torch.cat([mask, (~ended)[:, None].long()], 1)
        ended |= torch.isin(next_id, ends)
        if everyone_done(bool(ended.all())):
            break
    out = torch.stack(new, 1).cpu() if new else torch.zeros(len(prompts), 0, dtype=torch.long)
    continuations = []
    for row, done in zip(out, ended.cpu()):
        cut = int(torch.isin(row, ends.cpu()).nonzero()[0, 0]) + 1 if done else len(row)
        continuations.append(row[:cut])
    return continuations


def all_ranks_done(mine: bool, device: torch.device) -> bool:
    flag = torch.tensor([float(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def answer_length(reference: torch.Tensor, end_ids: list[int]) -> int:
    """Tokens of a reference before its end token: what a generation must fit to match it."""
    ended = torch.isin(reference, torch.tensor(end_ids, dtype=reference.dtype)).nonzero()
    return int(ended[0, 0]) if len(ended) else len(reference)


def generation_table(model, batches: Iterable[dict], tokenizer, count: int, max_new_tokens: int,
                     device: torch.device, max_new_tokens_setting: str = "eval.max_new_tokens") -> dict[str, list[str]]:
    """A table (column -> values) of prompt, reference and generated text for up to `count` eval prompts,
    the same on every rank (the prompts are decoded across the ranks of the default process group). Rank 0
    warns, once, of references longer than `max_new_tokens` (named `max_new_tokens_setting`)."""
    pairs = prompts_and_references(batches, count)
    rank, world = dist.get_rank(), dist.get_world_size()
    end_ids = end_token_ids(getattr(model, "generation_config", None), tokenizer)
    too_long = sum(answer_length(reference, end_ids) > max_new_tokens for _, reference in pairs)
    if too_long and rank == 0:
        warn_once(f"{too_long} of {len(pairs)} reference answers are longer than {max_new_tokens_setting}="
                   f"{max_new_tokens} tokens: their generations are cut short and can never match them; "
                   f"raise {max_new_tokens_setting}")
    mine = list(range(rank, len(pairs), world))
    prompts = [pairs[i][0] for i in mine] or [pairs[0][0] if pairs else torch.tensor([tokenizer.eos_token_id or 0])]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    was_training = model.training
    model.eval()
    texts = greedy_batch(model, prompts, max_new_tokens, end_ids, pad_id, device,
                         lambda mine_done: all_ranks_done(mine_done, device))
    model.train(was_training)
    release_free_host_memory()  # decoding grows its inputs a token at a time: every step a new size
    decoded = {i: tokenizer.decode(t, skip_special_tokens=True) for i, t in zip(mine, texts)}
    gathered: list[dict[int, str] | None] = [None] * world
    dist.all_gather_object(gathered, decoded)
    generated = {i: text for part in gathered for i, text in part.items()}
    return {"prompt": [tokenizer.decode(p, skip_special_tokens=True) for p, _ in pairs],
            "reference": [tokenizer.decode(r, skip_special_tokens=True) for _, r in pairs],
            "generated": [generated[i] for i in range(len(pairs))]}

"""The engine's scheduler and step, without threads: `add` sequences, call `step` until `busy` is False.

Each step:
1. sequences whose caller gave up leave; waiting ones take free slots, oldest first, while the rows, the step's
   token budget and the cache's memory budget allow (a sequence's cache is bounded by its prompt and max_tokens);
   sequences admitted together that share a prompt (a GRPO group's answers) have it computed once, its keys and
   values copied to the others' slots;
2. one forward over the step's tokens (app/engine/layout.py): each decoding sequence's last token, and a chunk
   of each new prompt (a prompt longer than the budget takes several steps; one whose log-probabilities are asked
   for is computed whole, so they are scored in one piece);
3. every sequence whose prompt is complete draws its next token (app/engine/sampling.py), or is scored only
   (max_tokens 0); those that ended leave their slot to the sequence in the last slot.

A step that fails (a bug, memory) fails the sequences it ran, and those waiting run on a fresh cache.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from app.engine.attention import NAME
from app.engine.cache import SlotCache
from app.engine.kernels import reorder_linears
from app.engine.layout import step_layout
from app.engine.routing import Router
from app.engine.sampling import draw, prompt_entries
from app.engine.sequence import Sequence

log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    """A model the engine cannot run (its attention does not go through transformers' AttentionInterface)."""


@dataclass(eq=False)
class Row:
    """A running sequence's place: its slot, the positions its cache holds, the tokens it feeds next."""

    seq: Sequence
    slot: int
    computed: int = 0
    feed: list[int] = field(default_factory=list)
    leader: Row | None = None  # a row whose prompt (the same) is computed for this one too
    chunk: int = 0  # tokens of `feed` in the current step

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.seq.prompt)

    @property
    def bound(self) -> int:
        """The most positions it can ever hold."""
        return len(self.seq.prompt) + self.seq.params.max_tokens


def use_engine_attention(model: nn.Module) -> None:
    """The model's attention layers through the engine's attention function (app/engine/attention.py); a model
    whose attention does not go through transformers' AttentionInterface is refused."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    message = f"{type(base).__name__}'s attention does not go through transformers' AttentionInterface"
    try:
        base.set_attn_implementation(NAME)
    except ValueError as e:  # transformers refuses the interface for this model
        raise UnsupportedModel(f"{message}: {e}") from None
    if base.config._attn_implementation != NAME:
        raise UnsupportedModel(f"{message}: the engine cannot run it")


def bytes_per_position(config) -> int | None:
    """A position's keys and values over every layer, in the model's dtype (None where the config does not say)."""
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    size = torch.finfo(getattr(config, "dtype", None) or torch.float32).bits // 8
    return layers * 2 * kv_heads * head_dim * size


class EngineCore:
    def __init__(self, model: nn.Module, end_ids: list[int], *, max_rows: int = 64, max_step_tokens: int = 512,
                 cache_gb: float | None = None):
        use_engine_attention(model)
        for param in model.parameters():
            param.requires_grad_(False)
        self.model, self.end_ids = model.eval(), set(end_ids)
        self.device = next(model.parameters()).device
        self.reordered = self.device.type == "cpu" and reorder_linears(model)  # before the base view copies them
        self.router = Router(model)
        self.cache = SlotCache()
        self.max_rows, self.max_step_tokens = max_rows, max_step_tokens
        self.per_position = bytes_per_position(model.config)
        self.cache_bytes = None if cache_gb is None else cache_gb * 2**30
        self.rows: list[Row] = []  # rows[i].slot == i
        self.waiting: deque[Sequence] = deque()
        self.steps = 0

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def step(self) -> list[Sequence]:
        """One step; the sequences it changed (those that ended among them, `done`)."""
        ended = self.leave_cancelled() + self.refuse_unknown()
        self.admit()
        if not self.rows:
            return ended
        try:
            changed = self.compute()
        except Exception as error:  # noqa: BLE001 - the step's sequences are told; the engine goes on
            log.exception("an engine step failed: its %d sequences with it", len(self.rows))
            return ended + self.fail(error)
        finally:
            self.steps += 1
        self.leave([row for row in self.rows if row.seq.done])
        return ended + changed

    def leave_cancelled(self) -> list[Sequence]:
        gone = [seq for seq in self.waiting if seq.cancelled.is_set()]
        self.waiting = deque(seq for seq in self.waiting if not seq.cancelled.is_set())
        for seq in gone:
            seq.finish = "cancelled"
        leaving = [row for row in self.rows if row.seq.cancelled.is_set()]
        for row in leaving:
            row.seq.finish = row.seq.finish or "cancelled"
        self.leave(leaving)
        return gone + [row.seq for row in leaving]

    def refuse_unknown(self) -> list[Sequence]:
        """Waiting sequences that name an adapter the model does not hold, failed (never run on the base)."""
        unknown = [seq for seq in self.waiting if not self.router.knows(seq.adapter)]
        for seq in unknown:
            seq.error = f"ValueError: adapter {seq.adapter!r} is not loaded"
        self.waiting = deque(seq for seq in self.waiting if self.router.knows(seq.adapter))
        return unknown

    def admit(self) -> None:
        budget = self.max_step_tokens - sum(1 for row in self.rows if not row.prefilling)
        leaders: dict[tuple[str | None, tuple[int, ...]], Row] = {}
        while self.waiting and len(self.rows) < self.max_rows and self.fits(self.waiting[0]):
            seq = self.waiting[0]
            shares = seq.params.prompt_logprobs is None  # a prompt scored is computed for its own sequence
            leader = leaders.get((seq.adapter, tuple(seq.prompt))) if shares else None
            if leader is None and budget <= 0 and self.rows:
                break
            self.waiting.popleft()
            row = Row(seq, len(self.rows), feed=list(seq.prompt), leader=leader)
            self.rows.append(row)
            if leader is None and shares:
                leaders[(seq.adapter, tuple(seq.prompt))] = row
            budget -= 0 if leader else len(seq.prompt)

    def fits(self, seq: Sequence) -> bool:
        """Whether the cache stays within its memory budget with `seq` admitted."""
        if self.cache_bytes is None or self.per_position is None or not self.rows:
            return True
        bound = max(max(row.bound for row in self.rows), len(seq.prompt) + seq.params.max_tokens)
        return (len(self.rows) + 1) * 2 ** math.ceil(math.log2(bound)) * self.per_position <= self.cache_bytes

    def scheduled(self) -> list[Row]:
        """The rows that compute this step: every one but those waiting for a leader's prompt; where the adapters'
        layers cannot share a forward (app/engine/routing.py), one adapter's rows, adapters taking turns."""
        rows = [row for row in self.rows if row.leader is None]
        adapters = list(dict.fromkeys(row.seq.adapter for row in rows))
        if len(adapters) > 1 and not self.router.mixable:
            turn = adapters[self.steps % len(adapters)]
            rows = [row for row in rows if row.seq.adapter == turn]
        return rows

    def chunked(self, rows: list[Row]) -> tuple[list[Row], list[Row]]:
        """(decoding rows, prefilling rows with a chunk this step): the budget's tokens, decoding rows first; a
        prompt whose log-probabilities are asked for whole; at least one prompt chunk when nothing decodes."""
        decoding = [row for row in rows if not row.prefilling]
        budget, filling = self.max_step_tokens - len(decoding), []
        for row in (row for row in rows if row.prefilling):
            whole = row.seq.params.prompt_logprobs is not None
            size = len(row.feed) if whole or (not decoding and not filling) else min(budget, len(row.feed))
            if size <= 0 or (whole and budget < size and (decoding or filling)):
                continue
            row.chunk, budget = size, budget - size
            filling.append(row)
        return decoding, filling

    def compute(self) -> list[Sequence]:
        decoding, filling = self.chunked(self.scheduled())
        self.cache.reserve(len(self.rows), max(row.computed + max(row.chunk, 1) for row in decoding + filling))
        layout = step_layout(self.cache, [(row.slot, row.computed, row.feed[0]) for row in decoding],
                             [(row.slot, row.computed, row.feed[:row.chunk]) for row in filling], self.device)
        wanted, at = list(range(len(decoding))), {}
        for segment, row in zip(layout.segments, filling):
            if row.computed + row.chunk == len(row.seq.prompt):  # the prompt completes: its next token is drawn
                scored = row.seq.params.prompt_logprobs is not None
                at[row] = len(wanted) + (row.chunk - 1 if scored else 0)
                wanted += list(range(segment.first, segment.first + row.chunk)) if scored else \
                    [segment.first + row.chunk - 1]
        adapters = [row.seq.adapter for row in decoding] + [row.seq.adapter for row in filling for _ in
                                                            range(row.chunk)]
        with torch.no_grad(), self.router.route(adapters) as module:
            logits = module(input_ids=layout.input_ids, position_ids=layout.position_ids, engine_step=layout,
                            logits_to_keep=torch.tensor(wanted, device=self.device), use_cache=False).logits[0]
        for row in decoding:
            row.computed += 1
        for row in filling:
            row.computed, row.feed = row.computed + row.chunk, row.feed[row.chunk:]
        return self.advance(logits, decoding, at)

    def advance(self, logits: torch.Tensor, decoding: list[Row], at: dict[Row, int]) -> list[Sequence]:
        """Prompts scored, followers given their leader's prompt, and each drawing row's next token taken."""
        drawing = [(row, i) for i, row in enumerate(decoding)]
        for row, index in at.items():
            top = row.seq.params.prompt_logprobs
            if top is not None:
                row.seq.prompt_logprobs, _ = prompt_entries(logits[index - len(row.seq.prompt) + 1:index + 1],
                                                            row.seq.prompt, top)
            followers = [other for other in self.rows if other.leader is row]
            self.cache.copy_prefix(row.slot, [f.slot for f in followers], row.computed)
            for follower in followers:
                follower.computed, follower.feed, follower.leader = row.computed, [], None
            drawing += [(r, index) for r in [row, *followers]]
        for row, _ in drawing:
            if row.seq.params.max_tokens == 0:
                row.seq.finish = "length"  # scored only
        drawing = [(row, index) for row, index in drawing if not row.seq.done]
        if drawing:
            indices = [index for _, index in drawing]
            rows = logits if indices == list(range(len(logits))) else logits[indices]  # no copy in the common case
            drawn = draw(rows, [row.seq.params for row, _ in drawing], [row.seq.generator for row, _ in drawing])
            for (row, _), token, logprob, top in zip(drawing, drawn.tokens, drawn.logprobs, drawn.top):
                row.seq.take(token, logprob, top, self.end_ids)
                row.feed = [token]
        return list(dict.fromkeys([row.seq for row in decoding] + [row.seq for row, _ in drawing] +
                                  [row.seq for row in at]))

    def leave(self, leaving: list[Row]) -> None:
        """The rows' slots freed: the row in the last slot moves into each (its cache with it)."""
        for row in sorted(leaving, key=lambda r: r.slot, reverse=True):
            for follower in (other for other in self.rows if other.leader is row):
                follower.leader = None  # its prompt is computed for it alone
            last = self.rows.pop()
            if last is not row:
                self.cache.move(last.slot, row.slot, last.computed)
                last.slot = row.slot
                self.rows[row.slot] = last

    def fail(self, error: Exception) -> list[Sequence]:
        """Every running sequence failed with `error`; a fresh cache for those that wait."""
        message = f"{type(error).__name__}: {error}"[:300]
        failed = [row.seq for row in self.rows]
        for seq in failed:
            seq.error = message
        self.rows, self.cache = [], SlotCache()
        return failed

"""Continuous batching for the rollout side: answers decoded together over one KV cache, each answer's row
leaving the batch as soon as it ends and a waiting prompt taking its place, so a batch is never held by its longest
answer and never computes rows that have ended.

Every answer draws its tokens with a generator of its own, seeded by its request's seed and its place in the
request: an answer is the same whichever answers share its batch, however many rows are decoded at once and
however many actors share a step's prompts, up to the rounding of batched products (in fp32 its log-probabilities
agree to 1e-5 and its tokens are the same unless a draw falls that close to a boundary; in bf16 a token may
differ now and then, so a resumed run's answers are the same draws, not always the same tokens). Its
log-probabilities are the policy's (the logits over the temperature, before top-k and top-p), as the trainer's
loss takes them.

The cache is transformers' DynamicCache: rows are left-padded (the attention mask marks the padding), each row
has its own positions, rows that end are dropped from every layer, and padding no row needs is trimmed. A prompt
that several answers share (a GRPO group's) goes through the model once, its cache rows copied to each answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer


@dataclass
class Answer:
    """One answer being decoded: its prompt, its generator, the tokens drawn and their log-probabilities."""

    prompt: list[int]
    generator: torch.Generator
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    done: bool = False

    @classmethod
    def seeded(cls, prompt: list[int], seed: int) -> Answer:
        return cls(prompt, torch.Generator().manual_seed(seed))


def answer_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th answer of a request seeded `seed`."""
    return (seed * 1_000_033 + index * 7_919 + 1) % 2**63


def supports_continuous_batching(model: nn.Module) -> bool:
    """Whether every layer of the model's cache is a plain full-attention DynamicLayer (sliding windows and other
    caches are decoded by transformers' `generate` instead)."""
    layers = DynamicCache(config=model.config).layers
    return all(type(layer) is DynamicLayer for layer in layers)


def filtered_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The logits with the tokens outside top-k and outside the top-p nucleus set to -inf (transformers' rules:
    the smallest set of most likely tokens whose probability reaches top_p, at least one)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=False)
        outside = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        outside[..., -1] = False
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


@dataclass(frozen=True)
class Drawing:
    """How tokens are drawn (the grpo section's): the temperature, top-k (0: all), top-p, and an answer's length."""

    temperature: float
    top_k: int
    top_p: float
    max_tokens: int


class DecodingBatch:
    """The answers being decoded together: their cache and attention mask, rows in the order of `active`."""

    def __init__(self, model: nn.Module, end_ids: list[int], pad_id: int, device: torch.device, drawing: Drawing):
        self.model, self.end_ids, self.pad_id, self.device = model, set(end_ids), pad_id, device
        self.drawing = drawing
        self.active: list[Answer] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.active)

    @torch.no_grad()
    def admit(self, answers: list[Answer]) -> None:
        """New answers' prompts through the model, each distinct prompt once (a group's answers share theirs; the
        prompts left-padded among themselves), its cache rows copied to each of its answers, their first tokens
        drawn, their rows joined to the batch's."""
        prompts = list(dict.fromkeys(tuple(a.prompt) for a in answers))
        width = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):], mask[i, width - len(prompt):] = torch.tensor(prompt), 1
        cache, mask = DynamicCache(config=self.model.config), mask.to(self.device)  # the mask stays where the cache is
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask,
                         position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        row_of = {prompt: i for i, prompt in enumerate(prompts)}
        rows = [row_of[tuple(a.prompt)] for a in answers]
        draw(answers, out.logits[rows, -1], self.drawing)
        cache, mask = kept(cache, mask, rows)  # one row per answer
        self.cache, self.mask = merged(self.cache, self.mask, cache, mask)
        self.active += answers
        self.drop_ended()

    @torch.no_grad()
    def advance(self) -> None:
        """Every active answer's last token through the model, and its next drawn."""
        last = torch.tensor([[a.ids[-1]] for a in self.active], device=self.device)
        positions = torch.tensor([[len(a.prompt) + len(a.ids) - 1] for a in self.active], device=self.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.active), 1)], dim=1)
        out = self.model(input_ids=last, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True)
        draw(self.active, out.logits[:, -1], self.drawing)
        self.drop_ended()

    def drop_ended(self) -> None:
        """The rows of answers that drew an end token or reached the length limit leave the batch."""
        for answer in self.active:
            answer.done = answer.ids[-1] in self.end_ids or len(answer.ids) >= self.drawing.max_tokens
        going = [i for i, answer in enumerate(self.active) if not answer.done]
        if not going:
            self.active, self.cache, self.mask = [], None, None
        elif len(going) < len(self.active):
            self.cache, self.mask = kept(self.cache, self.mask, going)
            self.active = [self.active[i] for i in going]


def decode(batch: DecodingBatch, answers: list[Answer], slots: int | None = None) -> list[Answer]:
    """The answers decoded in `batch`, at most `slots` rows at a time (None: all at once); a finished answer's
    slot goes to the next waiting one."""
    waiting = deque(answers)
    while waiting or len(batch):
        free = (slots or len(answers)) - len(batch)
        if waiting and free > 0:
            batch.admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
        else:
            batch.advance()
    return answers


def draw(answers: list[Answer], logits: torch.Tensor, drawing: Drawing) -> None:
    """Each answer's next token, drawn with its own generator from the filtered distribution; its log-probability
    under the policy (before the filters). Computed where the logits are: only a number per answer travels."""
    scaled = logits.float() / drawing.temperature
    cumulative = filtered_logits(scaled, drawing.top_k, drawing.top_p).softmax(dim=-1).cumsum(dim=-1)
    # u in (0, total]: the first token whose cumulative probability reaches u has a probability above 0
    draws = torch.cat([1 - torch.rand(1, generator=a.generator) for a in answers]).to(scaled.device)
    tokens = torch.searchsorted(cumulative, (draws * cumulative[:, -1])[:, None]).clamp(max=scaled.shape[-1] - 1)
    logps = torch.log_softmax(scaled, dim=-1).gather(-1, tokens)
    drawn = torch.cat([tokens.to(logps.dtype), logps], dim=1).tolist()  # one copy to the host
    for answer, (token, logp) in zip(answers, drawn):
        token = int(token)
        answer.ids.append(token)
        answer.logps.append(logp)


def merged(cache: DynamicCache | None, mask: torch.Tensor | None, new_cache: DynamicCache,
           new_mask: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Two batches' caches as one: the shorter left-padded to the longer (masked), the rows stacked."""
    if cache is None:
        return new_cache, new_mask
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, new_layer in zip(cache.layers, new_cache.layers):
        layer.keys = torch.cat([left_padded(layer.keys, width), left_padded(new_layer.keys, width)])
        layer.values = torch.cat([left_padded(layer.values, width), left_padded(new_layer.values, width)])
    mask = torch.cat([nn.functional.pad(mask, (width - mask.shape[1], 0)),
                      nn.functional.pad(new_mask, (width - new_mask.shape[1], 0))])
    return cache, mask


def left_padded(states: torch.Tensor, width: int) -> torch.Tensor:
    """Keys or values [rows, heads, length, dim] with zeros before them up to `width` positions."""
    return nn.functional.pad(states, (0, 0, width - states.shape[2], 0))


def kept(cache: DynamicCache, mask: torch.Tensor, rows: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """The cache and mask of `rows` only (a row named twice copied), without the leading positions that none of them
    attends to."""
    index = torch.tensor(rows, dtype=torch.long, device=mask.device)
    mask = mask[index]
    start = int(mask.any(dim=0).nonzero()[0, 0])
    for layer in cache.layers:
        layer.keys = layer.keys[index, :, start:]
        layer.values = layer.values[index, :, start:]
    return cache, mask[:, start:]

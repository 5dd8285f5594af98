"""Each row's next token, drawn as its own request says, and the log-probabilities asked for.

A row is greedy (temperature 0: the most likely token) or sampled: its logits over its temperature, outside its
top-k and top-p nucleus set to -inf (transformers' rules), and a draw u from its own generator taking the first
token whose cumulative probability reaches u (in vocabulary order). So a seeded row draws the same tokens whichever
rows share its batch, up to the rounding of batched products. Its log-probabilities are of the model's own
distribution (`model`: the logits as they come, what vLLM reports by default) or of the distribution it was
sampled from before the filters (`sampled`: the logits over the temperature, what a policy-gradient loss takes),
with the `top` most likely alternatives where asked for. Everything is computed where the logits are; one copy to
the host per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None for a prompt's first token
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this position, best first


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence's tokens are drawn and what is reported of them."""

    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    logprobs: int | None = None  # None: none; k: each generated token's, with k alternatives
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's (after the first), k alternatives
    logprobs_of: Literal["model", "sampled"] = "model"
    stops: tuple[str, ...] = ()  # stop sequences (the text up to the first one is the answer)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


@dataclass
class Drawn:
    """A step's tokens, one per row, their log-probabilities and alternatives (host lists)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[tuple[tuple[int, float], ...]]


def draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Drawn:
    """Each row's next token from `logits` [rows, vocabulary], and the log-probabilities asked for."""
    logits = logits.float()
    tokens = torch.zeros(len(params), dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        tokens[greedy] = rows_of(logits, greedy).argmax(dim=-1)
    chosen = torch.zeros(len(params), device=logits.device)
    if sampled:
        picked, logps = drawn_tokens(rows_of(logits, sampled), [params[i] for i in sampled],
                                     [generators[i] for i in sampled])
        tokens[sampled] = picked
        chosen[sampled] = logps
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None and (p.greedy or p.logprobs_of == "model")]
    top = max((params[i].logprobs for i in wanted), default=0)
    values, ids = logits[:0, :top], tokens[:0, None][:, :0]
    if wanted:  # the model's own distribution: the logits as they come
        logps = torch.log_softmax(rows_of(logits, wanted), dim=-1)
        chosen[wanted] = logps.gather(-1, tokens[wanted, None])[:, 0]
        values, ids = logps.topk(top, dim=-1) if top else (logps[:, :0], ids)
    host = torch.cat([tokens[:, None].to(chosen.dtype), chosen[:, None]], dim=1).tolist()
    alternatives: list[tuple] = [()] * len(params)
    for row, (vs, ts) in zip(wanted, zip(values.tolist(), ids.tolist())):
        k = params[row].logprobs
        alternatives[row] = tuple((int(t), v) for t, v in zip(ts[:k], vs[:k]))
    return Drawn([int(t) for t, _ in host], [lp for _, lp in host], alternatives)


def rows_of(matrix: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """matrix[rows], without copying the whole matrix where `rows` is all of it."""
    return matrix if len(rows) == len(matrix) else matrix[rows]


def drawn_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """Sampled rows' tokens (each row's filters, rows alike filtered together, then a draw from its generator) and
    their log-probabilities under the distribution they were drawn from before the filters."""
    scaled = logits / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    filtered, unfiltered = scaled, True
    for top_k, top_p in {(p.top_k, p.top_p) for p in params}:
        if top_k or top_p < 1.0:
            rows = [i for i, p in enumerate(params) if (p.top_k, p.top_p) == (top_k, top_p)]
            filtered, unfiltered = (filtered.clone() if unfiltered else filtered), False
            filtered[rows] = filtered_logits(scaled[rows], top_k, top_p)
    probabilities = filtered.softmax(dim=-1)
    cumulative = probabilities.cumsum(dim=-1)
    # u in (0, total]: the first token whose cumulative probability reaches u has a probability above 0
    draws = torch.cat([1 - torch.rand(1, generator=g) for g in generators]).to(logits.device)
    tokens = torch.searchsorted(cumulative, (draws * cumulative[:, -1])[:, None])[:, 0].clamp(max=logits.shape[-1] - 1)
    if unfiltered:  # the drawn distribution is the scaled one: its probability of each token drawn
        return tokens, probabilities.gather(-1, tokens[:, None])[:, 0].log()
    return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None])[:, 0]


def prompt_entries(logits: torch.Tensor, prompt: list[int], top: int) -> tuple[list[TokenLogprob], torch.Tensor]:
    """A prompt's tokens' entries (the first has none: nothing predicts it) from the logits at its positions
    [length, vocabulary], and the distribution of the token after it."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    chosen = logps[:-1].gather(-1, torch.tensor(prompt[1:], device=logps.device)[:, None])[:, 0].tolist()
    values, ids = logps[:-1].topk(top, dim=-1) if top else (logps[:-1, :0], logps[:-1, :0].long())
    entries = [TokenLogprob(prompt[0], None)] + [
        TokenLogprob(token, value, tuple(zip(row_ids, row_values)))
        for token, value, row_ids, row_values in zip(prompt[1:], chosen, ids.tolist(), values.tolist())]
    return entries, logps[-1]

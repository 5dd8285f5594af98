"""Log-probabilities for the API: a prompt's tokens (one forward pass: `echo` with `logprobs`, what
lm-evaluation-harness scores multiple-choice answers with) and each generated token's.

A generated token's log-probability is read from the scores `generate` computes for it, before temperature,
top_p and top_k reshape them: the model's own distribution, as vLLM reports by default. A prompt's first
token has none (nothing predicts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the alternatives per token


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None for a prompt's first token
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this position, best first


def entries(logprobs: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per token: `logprobs[i]` is the distribution (log-softmax over the vocabulary) `tokens[i]`
    was drawn from."""
    chosen = logprobs.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [TokenLogprob(token, value, tuple(zip(row_ids, row_values)))
            for token, value, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist())]


@torch.no_grad()
def score_prompts(model, adapters: dict, prompts: list[list[int]], pad: int,
                  top: list[int]) -> list[tuple[list[TokenLogprob], torch.Tensor]]:
    """For each prompt: its tokens' entries (`top[i]` alternatives each) and the distribution of the token
    after it. One forward pass of `model` (with `adapters`, the arguments that pick each row's adapter),
    right-padded: a real token never attends to padding and keeps its position, so each row scores as it
    would alone."""
    width = max(map(len, prompts))
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    logits = model(input_ids=ids, attention_mask=mask, **adapters).logits
    scored = []
    for row, (prompt, k) in enumerate(zip(prompts, top)):
        logprobs = torch.log_softmax(logits[row, :len(prompt)].float(), dim=-1)
        scored.append(([TokenLogprob(prompt[0], None), *entries(logprobs[:-1], prompt[1:], k)], logprobs[-1]))
    return scored


class StepLogprobs(LogitsProcessor):
    """Keeps each step's distribution (log-softmax of the scores as the model gave them) for the rows that
    asked for log-probabilities; the scores pass on unchanged. transformers runs a caller's processors after
    its own penalties and before temperature, top_p and top_k."""

    def __init__(self, wanted: list[bool]):
        self.wanted = wanted
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.last = torch.log_softmax(scores.float(), dim=-1) if any(self.wanted) else None
        return scores

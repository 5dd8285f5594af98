"""One request's row: its prompt, how it samples, its adapter, what it has generated, and how it ended.

The engine's thread appends each token (`take`), which decides whether the sequence has ended: at one of the
model's end tokens ("stop", the end token itself not part of the answer), at a stop sequence in its text ("stop"),
at `max_tokens` ("length"), or when its caller gave up on it (`cancelled`: "cancelled"). `listener` hears of it on
that thread: `listener(sequence, done)` after each step that changed it, and once more with done=True when it has
ended (with `finish` set) or failed (with `error` set).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.engine.sampling import SamplingParams, TokenLogprob
from app.engine.text import TextStream


def end_token_ids(generation_config, tokenizer) -> list[int]:
    """Every token that ends an answer: the model's generation config's eos_token_id (an int or a list: Gemma ends
    a turn with <end_of_turn>, Llama 3 with <|eot_id|>) and the tokenizer's eos."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = {configured} if isinstance(configured, int) else set(configured or ())
    return sorted(ids | ({tokenizer.eos_token_id} - {None}))


def seeded_generator(seed: int | None) -> torch.Generator:
    """A draw generator of its own for a sampled sequence: seeded by its request, or at random."""
    return torch.Generator().manual_seed(random.getrandbits(63) if seed is None else seed % 2**64)


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    adapter: str | None = None  # None: the base alone
    seed: int | None = None
    text: TextStream | None = None  # where the caller wants text (stop sequences need it)
    listener: Callable[[Sequence, bool], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    ids: list[int] = field(default_factory=list)  # generated (an end token last, if one ended it)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # each generated token's, where asked for
    prompt_logprobs: list[TokenLogprob] | None = None
    finish: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    ended_by_token: bool = False  # its last token is an end token

    def __post_init__(self):
        if not self.params.greedy and self.generator is None:
            self.generator = seeded_generator(self.seed)

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None

    @property
    def generated(self) -> int:
        """Tokens generated, the end token that ended it not counted (as usage counts them)."""
        return len(self.ids) - self.ended_by_token

    def take(self, token: int, logprob: float, top: tuple, end_ids: set[int]) -> None:
        """A generated token and its log-probability (kept where asked for): decides whether the sequence ends."""
        self.ids.append(token)
        if self.params.logprobs is not None:
            self.logprobs.append(TokenLogprob(token, logprob, top))
        if token in end_ids:
            self.finish, self.ended_by_token = "stop", True
            return
        if self.text is not None:
            self.text.push(token)
            if self.text.stopped:
                self.finish = "stop"
                return
        if len(self.ids) >= self.params.max_tokens:
            self.finish = "length"
        elif self.cancelled.is_set():
            self.finish = "cancelled"

    def tell(self, done: bool) -> None:
        if self.listener is not None:
            self.listener(self, done)

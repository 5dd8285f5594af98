"""A request in flight, as the API and every serving engine see it: what to generate, and the events that reach
the request's event loop as its answer comes.

Events: ("delta", text, n) as certain text comes (n: the generated tokens' log-probabilities known by then), then
("end", finish_reason, completion_tokens) or ("error", message). With `logprobs` (the alternatives wanted per
token, 0 for none) each generated token's log-probability is in `logprobs_of`; with `echo` too, the prompt's in
`prompt_logprobs`. `max_tokens` 0: the prompt scored only. A job whose client went away is `cancel`led: its
engine stops it at its next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.sampling import SamplingParams, TokenLogprob


@dataclass(eq=False)
class Job:
    prompt: list[int]
    adapter: str | None
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stops: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    logprobs_of: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    on_cancel: list[Callable[[], None]] = field(default_factory=list)  # what an engine does to stop it early

    def __post_init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()

    @property
    def scored(self) -> bool:
        """Whether the prompt's log-probabilities are asked for (`echo` with `logprobs`)."""
        return self.echo and self.logprobs is not None

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              logprobs=self.logprobs,
                              prompt_logprobs=self.logprobs if self.scored else None,
                              stops=tuple(self.stops))

    def emit(self, *event) -> None:
        """An event for the request, from any thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        """The client is gone (or the answer is complete): the engine may stop."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            for hook in self.on_cancel:
                hook()

"""Batched generation for the chat server: one thread owns the model and runs concurrent requests as
one `generate` call, each row with its own adapter (PEFT's `adapter_names`; `__base__` for none).

Requests that may share a call are those with the same sampling settings (every greedy one; sampled
ones with equal temperature and top_p; a seeded one alone). A row stops on its own: at an end-of-turn
token, at its `max_tokens`, at a stop sequence, or when its client is gone (`Job.cancelled`), all
decided by a `StoppingCriteria` that also hands each row's new text to its request as it comes.
Rows are static within a call: requests that arrive during one wait for the next (no continuous
batching).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

log = logging.getLogger(__name__)
NO_ADAPTER = "__base__"  # PEFT's row name for the base model alone


@dataclass(eq=False)
class Job:
    """One request's generation. Its events reach the request's event loop: ("delta", text) as text
    comes, then ("end", finish_reason, completion_tokens) or ("error", message)."""

    prompt: list[int]
    adapter: str | None
    max_tokens: int
    sampling: tuple
    stops: list[str] = field(default_factory=list)
    seed: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # what has been sent
    finish: str | None = None

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: it runs alone, so that seed alone decides its tokens."""
        return self.seed is not None and self.sampling[0] != "greedy"

    def __post_init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters may not be sent yet: an unfinished UTF-8 character, or the start of
    a stop sequence (the longest end of `text` that begins one). Linear in the stops' length."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    return max((_overlap(text[-(len(stop) - 1):] if len(stop) > 1 else "", stop) for stop in stops), default=0)


def _overlap(tail: str, stop: str) -> int:
    """The length of the longest suffix of `tail` that is a prefix of `stop` (Knuth-Morris-Pratt's matcher run
    over `tail`, shorter than `stop`): O(len(stop))."""
    failure, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        k += stop[i] == stop[k]
        failure[i] = k
    matched = 0
    for char in tail:
        while matched and char != stop[matched]:
            matched = failure[matched - 1]
        matched += char == stop[matched]
        if matched == len(stop):  # a whole stop inside the tail is cut by the caller; never here
            matched = failure[matched - 1]
    return matched


class _Rows(StoppingCriteria):
    """Per-row stopping for a batch, and the hand-off of each row's new text."""

    def __init__(self, engine: Engine, jobs: list[Job]):
        self.engine, self.jobs = engine, jobs

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        for job, token in zip(self.jobs, input_ids[:, -1].tolist(), strict=True):
            if job.finish is None:
                self.engine.advance(job, token)
        return torch.tensor([job.finish is not None for job in self.jobs], device=input_ids.device)


class Engine:
    def __init__(self, model, tokenizer, max_batch_size: int = 8, context: int | None = None,
                 batch_wait_s: float = 0.005):
        self.model, self.tokenizer, self.context = model, tokenizer, context
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        eos = model.generation_config.eos_token_id
        self.eos = {*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} - {None}
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos)
        self.incoming: queue.Queue[Job] = queue.Queue()
        self.batches = 0  # generate calls so far
        threading.Thread(target=self._serve_forever, name="generate", daemon=True).start()

    def submit(self, job: Job) -> None:
        self.incoming.put(job)

    def advance(self, job: Job, token: int) -> None:
        """Take one new token of `job`'s row: decide whether the row is finished, send the text that is
        certain (never a piece of a stop sequence, never half a character)."""
        if token in self.eos:
            job.finish = "stop"
        else:
            job.tokens.append(token)
        text = self.tokenizer.decode(job.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in job.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, job.finish = text[:cut], "stop"
        elif job.finish is None and len(job.tokens) >= job.max_tokens:
            job.finish = "length"
        elif job.finish is None and job.cancelled.is_set():
            job.finish = "cancelled"
        certain = text if job.finish else text[:len(text) - _held_back(text, job.stops)]
        if len(certain) > len(job.text) and certain.startswith(job.text):
            job.emit("delta", certain[len(job.text):])
            job.text = certain

    def _serve_forever(self) -> None:
        waiting: deque[Job] = deque()
        while True:
            if not waiting:
                waiting.append(self.incoming.get())
                time.sleep(self.batch_wait_s)  # let requests sent together arrive together
            while not self.incoming.empty():
                waiting.append(self.incoming.get_nowait())
            batch: list[Job] = []
            for job in waiting:  # alike, at most max_batch_size, and padded rows still within the context
                if batch and (waiting[0].seeded or job.seeded):
                    continue  # a seeded sampled job runs alone: its seed decides its batch's draws
                if job.sampling == waiting[0].sampling and len(batch) < self.max_batch_size and (
                        not batch or self._fits([*batch, job])):
                    batch.append(job)
            for job in batch:
                waiting.remove(job)
            live = [job for job in batch if not job.cancelled.is_set()]
            for job in set(batch) - set(live):
                job.emit("end", "cancelled", 0)
            if live:
                self._run(live)

    def _fits(self, jobs: list[Job]) -> bool:
        width = max(len(job.prompt) for job in jobs)
        return self.context is None or width + max(job.max_tokens for job in jobs) <= self.context

    def _run(self, jobs: list[Job]) -> None:
        width = max(len(job.prompt) for job in jobs)  # left padding: every row's next token is at the end
        ids = torch.tensor([[self.pad] * (width - len(job.prompt)) + job.prompt for job in jobs])
        mask = torch.tensor([[0] * (width - len(job.prompt)) + [1] * len(job.prompt) for job in jobs])
        kind, *settings = jobs[0].sampling
        sampling = {"do_sample": False} if kind == "greedy" else \
            {"do_sample": True, "temperature": settings[0], "top_p": settings[1], "top_k": None}
        try:
            if jobs[0].seeded:
                torch.manual_seed(jobs[0].seed)  # a seeded sampled job runs alone; greedy ones draw nothing
            with torch.no_grad():
                self.model.generate(input_ids=ids, attention_mask=mask, pad_token_id=self.pad, **sampling,
                                    max_new_tokens=max(job.max_tokens for job in jobs),
                                    stopping_criteria=StoppingCriteriaList([_Rows(self, jobs)]),
                                    adapter_names=[job.adapter or NO_ADAPTER for job in jobs])
        except Exception as e:  # a bug or a broken model: each request answers 500, the server lives on
            log.exception("generation failed")
            for job in jobs:
                job.emit("error", f"generation failed: {type(e).__name__}")
            return
        finally:
            self.batches += 1
        for job in jobs:
            job.emit("end", job.finish or "length", len(job.tokens))

"""Batched generation for the chat server: one thread owns the model and runs concurrent requests as
one `generate` call, each row with its own adapter (app/serve/routing.py picks the forward that does it).

Requests that may share a call are those with the same sampling settings (every greedy one; sampled
ones with equal temperature and top_p; a seeded one alone). A row stops on its own: at an end-of-turn
token, at its `max_tokens`, at a stop sequence, or when its client is gone (`Job.cancelled`), all
decided by a `StoppingCriteria` that also hands each row's new text to its request as it comes.
Rows are static within a call: requests that arrive during one wait for the next (no continuous
batching). A request that wants its prompt's log-probabilities (`echo`) is scored first, in one forward
pass with the others waiting for that; one that wants a single greedy token more takes it from that pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from app.serve.logprobs import StepLogprobs, TokenLogprob, entries, score_prompts
from app.serve.routing import Router

log = logging.getLogger(__name__)
RETIRE_AFTER_S = 5.0  # a replaced adapter is deleted once unused this long after its replacement


@dataclass(eq=False)
class _Chore:
    """Work on the model itself (loading an adapter), done by the generation thread between two batches."""

    work: object  # a callable
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(eq=False)
class Job:
    """One request's generation. Its events reach the request's event loop: ("delta", text, n) as text
    comes (n: the generated tokens' log-probabilities known by then), then ("end", finish_reason,
    completion_tokens) or ("error", message).

    With `logprobs` (the alternatives wanted per token, 0 for none) each generated token's log-probability
    is kept in `logprobs_of`; with `echo` too, the prompt's in `prompt_logprobs`. `max_tokens` 0: scored only."""

    prompt: list[int]
    adapter: str | None
    max_tokens: int
    sampling: tuple
    stops: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)
    logprobs_of: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    text: str = ""  # what has been sent
    finish: str | None = None

    @property
    def unscored(self) -> bool:
        return self.echo and self.logprobs is not None and self.prompt_logprobs is None

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

    def __init__(self, engine: Engine, jobs: list[Job], step: StepLogprobs):
        self.engine, self.jobs, self.step = engine, jobs, step

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        for row, (job, token) in enumerate(zip(self.jobs, input_ids[:, -1].tolist(), strict=True)):
            if job.finish is None:
                self.engine.advance(job, token, None if self.step.last is None else self.step.last[row])
        return torch.tensor([job.finish is not None for job in self.jobs], device=input_ids.device)


class Engine:
    def __init__(self, model, tokenizer, max_batch_size: int = 8, context: int | None = None,
                 batch_wait_s: float = 0.005):
        self.model, self.tokenizer, self.context = model, tokenizer, context
        self.router = Router(model)
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        eos = model.generation_config.eos_token_id
        self.eos = {*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} - {None}
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos)
        self.incoming: queue.Queue[Job | _Chore] = queue.Queue()
        self.retired: dict[str, float] = {}  # replaced adapters -> when; deleted once no job waits on them
        self.batches = 0  # generate calls so far
        threading.Thread(target=self._serve_forever, name="generate", daemon=True).start()

    def submit(self, job: Job) -> None:
        self.incoming.put(job)

    def between_batches(self, work) -> concurrent.futures.Future:
        """Run `work()` in the generation thread when no batch runs (PEFT's adapters change there only)."""
        chore = _Chore(work)
        self.incoming.put(chore)
        return chore.done

    def retire(self, adapter: str) -> None:
        """`adapter` answers no new request: delete it once the jobs that named it have ended."""
        self.between_batches(lambda: self.retired.setdefault(adapter, time.monotonic()))

    def _take(self, item: Job | _Chore, waiting: deque[Job]) -> None:
        if isinstance(item, Job):
            waiting.append(item)
            return
        try:
            item.done.set_result(item.work())
        except Exception as e:  # the caller hears of it; generation goes on
            item.done.set_exception(e)
        finally:
            self.router.forget()  # a chore may load or delete adapters

    def _delete_retired(self, waiting: deque[Job]) -> None:
        for adapter, since in list(self.retired.items()):
            if time.monotonic() - since >= RETIRE_AFTER_S and all(job.adapter != adapter for job in waiting):
                self.model.delete_adapter(adapter)
                self.router.forget()
                del self.retired[adapter]

    def advance(self, job: Job, token: int, logprobs: torch.Tensor | None = None) -> None:
        """Take one new token of `job`'s row (and the distribution it came from): decide whether the row is
        finished, send the text that is certain (never a piece of a stop sequence, never half a character)."""
        if job.logprobs is not None and logprobs is not None:  # the end-of-turn token's too, as vLLM reports it
            job.logprobs_of += entries(logprobs.unsqueeze(0), [token], job.logprobs)
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
            job.emit("delta", certain[len(job.text):], len(job.logprobs_of))
            job.text = certain

    def _serve_forever(self) -> None:
        waiting: deque[Job] = deque()
        while True:
            if not waiting:
                self._take(self.incoming.get(), waiting)
                time.sleep(self.batch_wait_s)  # let requests sent together arrive together
            while not self.incoming.empty():
                self._take(self.incoming.get_nowait(), waiting)
            self._delete_retired(waiting)
            if not waiting:
                continue
            if any(job.unscored for job in waiting):
                self._score_prompts(waiting)
                continue
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

    def _score_prompts(self, waiting: deque[Job]) -> None:
        """Score the prompts of up to max_batch_size waiting jobs that echo them; each then ends, takes its one
        greedy token from the same pass, or waits for generation."""
        batch = [job for job in waiting if job.unscored and not job.cancelled.is_set()][:self.max_batch_size]
        for job in [job for job in waiting if job.unscored and job.cancelled.is_set()]:
            waiting.remove(job)
            job.emit("end", "cancelled", 0)
        for job in batch:
            waiting.remove(job)
        if not batch:
            return
        scored = self._attempt(batch, "scoring", lambda: score_prompts(
            *self.router.route([job.adapter for job in batch]), [job.prompt for job in batch], self.pad,
            [job.logprobs for job in batch]))
        if scored is None:
            return
        for job, (prompt_logprobs, following) in zip(batch, scored):
            job.prompt_logprobs = prompt_logprobs
            if job.max_tokens == 1 and job.sampling == ("greedy",):
                self.advance(job, int(following.argmax()), following)
            if job.max_tokens == 0 or job.finish is not None:
                job.emit("end", job.finish or "length", len(job.tokens))
            else:
                waiting.appendleft(job)

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
        step = StepLogprobs([job.logprobs is not None for job in jobs])

        def generate() -> bool:
            if jobs[0].seeded:
                torch.manual_seed(jobs[0].seed)  # a seeded sampled job runs alone; greedy ones draw nothing
            model, adapters = self.router.route([job.adapter for job in jobs])
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, pad_token_id=self.pad, **sampling, **adapters,
                               max_new_tokens=max(job.max_tokens for job in jobs),
                               logits_processor=LogitsProcessorList([step] if any(step.wanted) else []),
                               stopping_criteria=StoppingCriteriaList([_Rows(self, jobs, step)]))
            return True

        if self._attempt(jobs, "generation", generate):
            for job in jobs:
                job.emit("end", job.finish or "length", len(job.tokens))

    def _attempt(self, jobs: list[Job], what: str, work):
        """`work()` on a batch; a failure (a bug, a broken model) answers each of its requests 500 and the server
        lives on: None then."""
        try:
            return work()
        except Exception as e:
            log.exception("%s failed", what)
            for job in jobs:
                job.emit("error", f"{what} failed: {type(e).__name__}")
            return None
        finally:
            self.batches += 1

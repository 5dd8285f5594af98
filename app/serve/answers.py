"""The answers' bodies in OpenAI's shapes: chat and text completions, whole or as server-sent events, with
the log-probabilities each asked for.

Text completions carry `logprobs: {tokens, token_logprobs, top_logprobs, text_offset}` (the prompt's first,
with `echo`: lm-evaluation-harness sums `token_logprobs` over an answer's positions); chat completions
`logprobs: {content: [{token, logprob, bytes, top_logprobs}]}`. A token is shown as its own decoded text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import lru_cache

from app.engine.sampling import TokenLogprob
from app.serve.jobs import Job
from app.serve.protocol import ApiError


class TokenText:
    """Each token's text, decoded once."""

    def __init__(self, tokenizer):
        self.of = lru_cache(maxsize=65536)(lambda token: tokenizer.decode([token]))
        self.of_all = tokenizer.decode  # a prompt's text, as `echo` shows it


def completion_logprobs(entries: list[TokenLogprob], text: TokenText, offset: int = 0) -> dict:
    tokens = [text.of(entry.token) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [None if entry.logprob is None else {text.of(t): lp for t, lp in entry.top}
                             for entry in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], text: TokenText) -> dict:
    def one(token: int, logprob: float) -> dict:
        shown = text.of(token)
        return {"token": shown, "logprob": logprob, "bytes": list(shown.encode("utf-8", "surrogatepass"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def usage(jobs: list[Job], completion_tokens: int) -> dict:
    prompt = sum(len(job.prompt) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


async def events(job: Job) -> AsyncIterator[tuple]:
    """The job's events as they come; text that arrived while the last piece was being sent comes as one delta
    (a client that reads slower than the engine writes gets fewer, longer pieces, not a growing backlog)."""
    while True:
        event = await job.events.get()
        while event[0] == "delta" and not job.events.empty():
            following = job.events.get_nowait()
            if following[0] != "delta":
                yield event
                event = following
                break
            event = ("delta", event[1] + following[1], following[2])
        if event[0] == "error":
            raise ApiError(500, event[1], None, "generation_failed", "server_error")
        yield event
        if event[0] == "end":
            return


async def answer(job: Job) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) once the job has ended; the job stops if this is cancelled."""
    try:
        text, finish, completion = "", "length", 0
        async for event in events(job):
            if event[0] == "delta":
                text += event[1]
            else:
                finish, completion = event[1], event[2]
        return text, finish, completion
    finally:
        job.cancel()  # a no-op once finished; stops the row if this request was cancelled


# A streamed choice's body: (text, the generated tokens' new log-probabilities, finish_reason or None)
Piece = Callable[[str, list[TokenLogprob], str | None], dict]


async def stream(job: Job, head: dict, include_usage: bool, piece: Piece,
                 opening: Callable[[], dict]) -> AsyncIterator[str]:
    """Server-sent events: `opening()` (the first choice body, made once the job has begun: an echoed prompt's
    log-probabilities are known then), a chunk per piece of text with the log-probabilities known by then, the
    finish, OpenAI's usage chunk if asked, then `[DONE]`."""
    def chunk(choice: dict | None, **extra) -> str:
        choices = [] if choice is None else [{"index": 0, **choice}]
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    sent, opened = 0, False
    try:
        async for event in events(job):
            if not opened:
                yield chunk(opening())
                opened = True
            if event[0] == "delta":
                yield chunk(piece(event[1], job.logprobs_of[sent:event[2]], None))
                sent = event[2]
            else:
                yield chunk(piece("", job.logprobs_of[sent:], event[1]))
                if include_usage:  # OpenAI's last chunk: no choices, the usage
                    yield chunk(None, usage=usage([job], event[2]))
        yield "data: [DONE]\n\n"
    except ApiError as error:  # the status line is sent already: the error goes in the stream
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        job.cancel()

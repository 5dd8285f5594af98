"""Each serving engine behind the API: concurrent requests over two adapters and the base, with prompts of different
lengths, each answers as plain PEFT does alone (this project's engine: all in shared steps); a request whose client
is gone stops generating."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from app.serve.jobs import Job
from tests.unit.serve.conftest import steps
from tests.unit.serve.reference import QUESTION, plain_greedy


async def _collect(job: Job) -> tuple[str, str, int]:
    text = ""
    while (event := await job.events.get())[0] == "delta":
        text += event[1]
    assert event[0] == "end", event
    return text, event[1], event[2]


def test_a_burst_over_two_adapters_and_the_base_answers_as_plain_peft(served, client, adapters, embedded,
                                                                      engine_name):
    names = ["noisy", "base", "other", "noisy", "base", "other"]
    questions = [[{"role": "user", "content": text}] for text in ("Write 5 in words.", "Spell out the number 912.")]
    asked = [(name, questions[i % 2]) for i, name in enumerate(names)]
    before = steps(served)
    with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
        replies = list(pool.map(lambda a: client.chat.completions.create(
            model=a[0], messages=a[1], max_tokens=12).choices[0].message.content, asked))
    expected = {(name, i % 2): plain_greedy(embedded["model"], adapters.get(name), questions[i % 2])
                for i, name in enumerate(names)}
    assert replies == [expected[(name, i % 2)] for i, name in enumerate(names)]
    assert len({expected[(name, 0)] for name in ("noisy", "base", "other")}) == 3  # three different models
    if engine_name == "transformers":  # one forward a token for all of them, not one per request
        assert steps(served) - before < 6 * 13, steps(served) - before


def test_a_cancelled_request_stops_generating(served):
    engine, tokenizer = served
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]

    async def cancel_after_first_text():
        job = Job(prompt=prompt, adapter="noisy", max_tokens=200)
        engine.submit(job)
        first = await job.events.get()
        job.cancel()  # what the API does when the client disconnects or the request times out
        return first, await _collect(job)

    first, (_, finish, tokens) = asyncio.run(cancel_after_first_text())
    assert first[0] == "delta" and finish == "cancelled" and tokens < 20, (finish, tokens)
    _settled(served)  # the engine's own end of the request lands after its last event (vLLM counts it then)


def _settled(served, quiet: float = 0.5, limit: float = 15.0) -> None:
    """Wait until the engine's step count stops moving; an engine still stepping `limit` s on fails the test."""
    deadline, count = time.monotonic() + limit, steps(served)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        if steps(served) == count:
            return
        count = steps(served)
    raise AssertionError(f"the engine still steps {limit:g} s after the request was cancelled")

"""Batched generation: concurrent requests over two adapters and the base share generate calls and each
answers as plain PEFT does alone; a request whose client is gone stops generating."""

from __future__ import annotations

import asyncio
import concurrent.futures

from app.serve.engine import Job
from tests.unit.serve.reference import QUESTION, plain_greedy


async def _collect(job: Job) -> tuple[str, str, int]:
    text = ""
    while (event := await job.events.get())[0] == "delta":
        text += event[1]
    assert event[0] == "end", event
    return text, event[1], event[2]


def test_a_burst_over_two_adapters_and_the_base_is_batched_and_answers_as_plain_peft(served, client, adapters,
                                                                                      embedded):
    names = ["noisy", "base", "other", "noisy", "base", "other"]
    before = served[0].engine.batches
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(lambda name: client.chat.completions.create(
            model=name, messages=QUESTION, max_tokens=12).choices[0].message.content, names))
    batches = served[0].engine.batches - before
    expected = {name: plain_greedy(embedded["model"], adapters.get(name)) for name in set(names)}
    assert replies == [expected[name] for name in names]
    assert len(set(expected.values())) == 3  # three different models
    assert batches < len(names), f"{len(names)} concurrent requests took {batches} generate calls"


def test_prompts_of_different_lengths_in_one_batch_answer_as_alone(served, embedded, adapters):
    engine, tokenizer = served
    questions = [[{"role": "user", "content": text}] for text in ("Write 5 in words.", "Spell out the number 912.")]

    async def burst():
        jobs = [Job(prompt=tokenizer.apply_chat_template(q, add_generation_prompt=True)["input_ids"], adapter=adapter,
                    max_tokens=8, sampling=("greedy",)) for q in questions for adapter in ("other", None)]
        before = engine.engine.batches
        for job in jobs:
            engine.engine.submit(job)
        return await asyncio.gather(*map(_collect, jobs)), engine.engine.batches - before

    results, batches = asyncio.run(burst())
    assert batches == 1
    assert [text for text, _, _ in results] == [plain_greedy(embedded["model"], adapter, q, 8)
                                                for q in questions for adapter in (adapters["other"], None)]


def test_a_cancelled_request_stops_generating(served):
    engine, tokenizer = served
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]

    async def cancel_after_first_text():
        job = Job(prompt=prompt, adapter="noisy", max_tokens=200, sampling=("greedy",))
        engine.engine.submit(job)
        first = await job.events.get()
        job.cancelled.set()  # what the API does when the client disconnects or the request times out
        return first, await _collect(job)

    first, (_, finish, tokens) = asyncio.run(cancel_after_first_text())
    assert first[0] == "delta" and finish == "cancelled" and tokens < 20, (finish, tokens)


def test_rows_that_would_overrun_the_context_once_padded_run_in_separate_batches(served):
    engine, tokenizer = served
    short = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]
    long = tokenizer.apply_chat_template([{"role": "user", "content": "seven " * 100}], add_generation_prompt=True)
    long = long["input_ids"]
    assert len(long) + 8 <= engine.context < len(long) + engine.context - len(short)

    async def both():
        jobs = [Job(prompt=long, adapter=None, max_tokens=8, sampling=("greedy",)),
                Job(prompt=short, adapter=None, max_tokens=engine.context - len(short), sampling=("greedy",))]
        before = engine.engine.batches
        for job in jobs:
            engine.engine.submit(job)
        await asyncio.gather(*map(_collect, jobs))
        return engine.engine.batches - before

    assert asyncio.run(both()) == 2

"""Closed-loop load on an OpenAI-compatible chat server: N clients, each sending its requests one after another,
answers of mixed lengths, every request streamed so its first token's time is seen.

Each client alternates a long answer (`long_tokens`) and a short one (`short_tokens`), starting with either
by its number, at temperature `temperature`; each request asks for the usage chunk, so the generated tokens
are the server's own count. What a request measures: its latency (sent to the last chunk), its time to first
token (sent to the first chunk with text), its generated tokens. A run's figures: requests/s and generated
tokens/s over the run's wall time, p50/p95 latency, p50/p95 time to first token, and the failed requests.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import aiohttp

LONG_PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
                "Explain how a bicycle stays upright, step by step, for a curious child.",
                "Describe a walk through a busy market in a city you imagine, in detail.",
                "Write a letter from a sailor to his sister about the storm last night."]
SHORT_PROMPTS = ["What is 7 plus 5?", "Name a colour.", "What is the capital of France?", "Say hello."]


@dataclass
class Shape:
    """What the clients ask: the long and short answers' token limits, the temperature, requests per client."""

    long_tokens: int = 160
    short_tokens: int = 8
    temperature: float = 0.7
    requests_per_client: int = 3


@dataclass
class Outcome:
    latency: float
    first_token: float | None
    tokens: int
    error: str | None = None


async def one_request(http: aiohttp.ClientSession, url: str, body: dict) -> Outcome:
    started, first, tokens = time.perf_counter(), None, 0
    try:
        async with http.post(url, json=body) as response:
            if response.status != 200:
                return Outcome(time.perf_counter() - started, None, 0, f"http {response.status}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(time.perf_counter() - started, first, tokens, "stream error")
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Outcome(time.perf_counter() - started, first, tokens, f"transport {type(e).__name__}")
    return Outcome(time.perf_counter() - started, first, tokens)


async def client(i: int, http: aiohttp.ClientSession, url: str, model: str, shape: Shape) -> list[Outcome]:
    outcomes = []
    for n in range(shape.requests_per_client):
        long = (i + n) % 2 == 0
        prompts = LONG_PROMPTS if long else SHORT_PROMPTS
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                "temperature": shape.temperature, "max_tokens": shape.long_tokens if long else shape.short_tokens,
                "messages": [{"role": "user", "content": prompts[(i + n) % len(prompts)]}]}
        outcomes.append(await one_request(http, url, body))
    return outcomes


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def figures(outcomes: list[Outcome], seconds: float) -> dict:
    done = [o for o in outcomes if o.error is None]
    latencies = [o.latency for o in done]
    first = [o.first_token for o in done if o.first_token is not None]
    rounded = lambda x: None if x is None else round(x, 3)
    return {"requests": len(outcomes), "failed": len(outcomes) - len(done),
            "errors": sorted({o.error for o in outcomes if o.error}), "seconds": round(seconds, 2),
            "requests_per_second": round(len(done) / seconds, 3),
            "generated_tokens_per_second": round(sum(o.tokens for o in done) / seconds, 1),
            "p50_latency_s": rounded(statistics.median(latencies) if latencies else None),
            "p95_latency_s": rounded(percentile(latencies, 0.95)),
            "p50_first_token_s": rounded(statistics.median(first) if first else None),
            "p95_first_token_s": rounded(percentile(first, 0.95))}


async def load(base_url: str, api_key: str, model: str, clients: int, shape: Shape) -> dict:
    """`clients` clients against the server at `base_url` (…/v1), every request to `model`: the run's figures."""
    headers = {"Authorization": f"Bearer {api_key}"}
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as http:
        started = time.perf_counter()
        runs = await asyncio.gather(*(client(i, http, f"{base_url}/chat/completions", model, shape)
                                      for i in range(clients)))
        seconds = time.perf_counter() - started
    return figures([o for run in runs for o in run], seconds)


def run_load(base_url: str, api_key: str, model: str, clients: int, shape: Shape) -> dict:
    return asyncio.run(load(base_url, api_key, model, clients, shape))

"""A soak of the chat server: concurrent clients for minutes against `jobs.serve` with 2 replicas, one replica
killed half-way.

    python -m benchmarks.serve_soak --adapter a=RUN_OR_FOLDER --adapter b=RUN_OR_FOLDER [--clients 12] [--minutes 4]

Starts `python -m jobs.serve --replicas 2` (an API key, the adapters and their base) on a free loopback port.
`--clients` asyncio clients (aiohttp: real HTTP over loopback) send requests back to back: each in turn to the base
or an adapter, half of them streamed, and one streamed request in ten dropped after its first chunk (a client
that goes away). Half-way through, one replica's process is SIGKILLed (Serve starts another). The replicas'
resident memory is sampled every 5 s. At the end, as many requests as the replicas take at once are sent
together: each must be answered, so no slot is still held for a client that left. Prints one JSON line
(requests, failures by kind and whether they were in flight when the replica died, p50/p99 latency, memory over
time and its growth after warm-up) and writes it to <out>/serve_soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

from app.tracking.adapters import adapter_folder, base_of
from benchmarks.serve import PROMPTS, free_port, start, wait_ready

WARMUP_SECONDS = 30.0  # memory is compared from here on: models loaded, the first batches' buffers allocated


def replica_processes() -> list[psutil.Process]:
    """Serve's replica actors on this host (Ray titles their processes `ray::ServeReplica:APP:DEPLOYMENT`)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "ServeReplica:" in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


async def one_request(http: aiohttp.ClientSession, body: dict, drop: bool) -> str:
    """The outcome: ok, dropped (left on purpose), http <status>, stream error, cut (no [DONE]), transport."""
    try:
        async with http.post("/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return f"http {response.status}"
            if not body["stream"]:
                await response.read()
                return "ok"
            async for raw in response.content:
                line = raw.decode().strip()
                if drop and line.startswith("data: {"):
                    response.close()  # the connection closed mid-stream: the client went away
                    return "dropped"
                if line.startswith('data: {"error"'):
                    return "stream error"
                if line == "data: [DONE]":
                    return "ok"
            return "cut"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"transport {type(e).__name__}"


async def client_loop(i: int, http: aiohttp.ClientSession, models: list[str], args, until: float, log: list) -> None:
    n = 0
    while time.monotonic() < until:
        stream = (i + n) % 2 == 0
        body = {"model": models[(i + n) % len(models)], "stream": stream, "temperature": 0,
                "max_tokens": args.max_tokens, "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}]}
        started = time.monotonic()
        outcome = await one_request(http, body, drop=stream and (3 * i + n) % 10 == 0)
        log.append((started, time.monotonic(), outcome))
        n += 1


async def kill_one_replica(after: float, record: dict) -> None:
    await asyncio.sleep(after)
    victim = replica_processes()[0]
    record |= {"at": time.monotonic(), "pid": victim.pid}
    victim.send_signal(signal.SIGKILL)


async def sample_memory(until: float, every: float, samples: list) -> None:
    while time.monotonic() < until:
        rss = {}
        for proc in replica_processes():
            try:
                rss[proc.pid] = proc.memory_info().rss / 2**20
            except psutil.Error:
                pass
        samples.append((time.monotonic(), rss))
        await asyncio.sleep(every)


async def every_slot_answers(http: aiohttp.ClientSession, models: list[str], count: int) -> dict:
    """`count` requests at once (what the replicas take together): all answered, none refused or queued out."""
    bodies = [{"model": models[i % len(models)], "stream": False, "temperature": 0, "max_tokens": 4,
               "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]} for i in range(count)]
    outcomes = await asyncio.gather(*(one_request(http, body, drop=False) for body in bodies))
    return {"requests": count, "answered": outcomes.count("ok")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def summary(log: list, kill: dict, samples: list, started: float) -> dict:
    failed = [(s, e, o) for s, e, o in log if o not in ("ok", "dropped")]
    in_flight = lambda s, e: s < kill["at"] <= e  # noqa: E731
    latencies = [e - s for s, e, o in log if o == "ok"]
    warm = [rss for t, rss in samples if t - started >= WARMUP_SECONDS and rss]
    survivors = set(warm[0]) & set(warm[-1]) if warm else set()
    return {
        "requests": len(log), "outcomes": dict(sorted(Counter(o for *_, o in log).items())),
        "killed_replica_at_s": round(kill["at"] - started, 1),
        "in_flight_at_kill": sum(in_flight(s, e) for s, e, _ in log),
        "failed_in_flight_at_kill": sum(in_flight(s, e) for s, e, _ in failed),
        "failed_otherwise": sum(not in_flight(s, e) for s, e, _ in failed),
        "p50_latency_s": round(statistics.median(latencies), 3) if latencies else None,
        "p99_latency_s": round(percentile(latencies, 0.99), 3),
        "replica_rss_mb_over_time": [(round(t - started), {str(p): round(m) for p, m in rss.items()})
                                     for t, rss in samples[::6]],
        "surviving_replica_rss_growth_mb_after_warmup": {str(p): round(warm[-1][p] - warm[0][p], 1) for p in survivors},
    }


async def soak(port: int, key: str, models: list[str], args) -> dict:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"},
                                     timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        started = time.monotonic()
        until = started + args.minutes * 60
        log, kill, samples = [], {}, []
        await asyncio.gather(*(client_loop(i, http, models, args, until, log) for i in range(args.clients)),
                             kill_one_replica(args.minutes * 30, kill), sample_memory(until, 5.0, samples))
        await asyncio.sleep(5)  # the last dropped streams' rows end at their next token
        slots = await every_slot_answers(http, models, 2 * args.max_ongoing_requests)
    return summary(log, kill, samples, started) | {"every_slot_answers": slots}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_soak", description=__doc__.split("\n")[0])
    p.add_argument("--adapter", action="append", required=True, metavar="NAME=SOURCE")
    p.add_argument("--output-dir", default="outputs")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-ongoing-requests", type=int, default=16, help="per replica")
    p.add_argument("--out", default="outputs/benchmark/serve_soak")
    args = p.parse_args(argv)
    names = [spec.partition("=")[0] for spec in args.adapter]
    base_of(adapter_folder(args.adapter[0].partition("=")[2], args.output_dir))  # fails early on a wrong source
    key, port = secrets.token_urlsafe(24), free_port()
    command = [sys.executable, "-m", "jobs.serve", "--replicas", "2", "--port", str(port), "--output-dir",
               args.output_dir, "--max-batch-size", "8", "--max-ongoing-requests", str(args.max_ongoing_requests),
               *(a for spec in args.adapter for a in ("--adapter", spec))]
    server = start(command, {**os.environ, "SERVE_API_KEY": key})
    try:
        from openai import OpenAI

        wait_ready(OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0), server, "base")
        report = {"clients": args.clients, "minutes": args.minutes, "max_tokens": args.max_tokens, "replicas": 2,
                  **asyncio.run(soak(port, key, ["base", *names], args))}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "serve_soak.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

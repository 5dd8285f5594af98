"""Serving under load: N concurrent clients against one at a time, on jobs.serve and `transformers serve`.

    python -m benchmarks.serve --adapter a=RUN_OR_FOLDER --adapter b=RUN_OR_FOLDER [--clients 8] [--max-tokens 64]

Starts `python -m jobs.serve` (an API key, the adapters and their base) and `transformers serve BASE` (the
transformers CLI's OpenAI-compatible server: the base alone, it serves no LoRA adapter), each on a free
loopback port. On each: N greedy requests one after another, then the same N at once (N threads of the
OpenAI client), `--rounds` times; jobs.serve's requests cycle over the base and every adapter,
transformers serve's all go to the base. Then a lone request's latency, like for like: the base on both, one
request at a time (`--rounds` x N), the same prompts and greedy tokens. Prints one JSON line: completion
tokens/s and p50/p99 latency of each way, the speed-up of concurrent over sequential, and the lone request's
p50 latency and tokens on each server with their ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time

from app.tracking.adapters import adapter_folder, base_of

PROMPTS = ["Write 347 in words.", "Write 1208 in words.", "Write 56 in words.", "Write 9021 in words."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def stop_server(server: subprocess.Popen, sig: int) -> None:
    """`sig` to the server's process group; SIGKILL if it has not ended a minute later."""
    os.killpg(server.pid, sig)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def wait_ready(client, server: subprocess.Popen, model: str, timeout: float = 300) -> None:
    """Until the server answers a one-token request (it loads the model on the first one)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            return
        except Exception:
            time.sleep(1)
    raise SystemExit(f"no answer within {timeout} s")


def measure(client, models: list[str], clients: int, max_tokens: int, rounds: int) -> dict:
    def one(i: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        answer = client.chat.completions.create(model=models[i % len(models)], temperature=0, max_tokens=max_tokens,
                                                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        return time.perf_counter() - t0, answer.usage.completion_tokens

    figures = {"sequential": [], "concurrent": []}
    for _ in range(rounds):
        for way in figures:
            t0 = time.perf_counter()
            if way == "sequential":
                results = [one(i) for i in range(clients)]
            else:
                with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                    results = list(pool.map(one, range(clients)))
            figures[way].append((time.perf_counter() - t0, results))
    out = {}
    for way, runs in figures.items():
        latencies = sorted(latency for _, results in runs for latency, _ in results)
        out[way] = {"seconds": statistics.median(seconds for seconds, _ in runs),
                    "completion_tokens_per_second": sum(n for _, r in runs for _, n in r) / sum(s for s, _ in runs),
                    "p50_latency_s": statistics.median(latencies),
                    "p99_latency_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]}
    out["concurrent_speedup"] = out["sequential"]["seconds"] / out["concurrent"]["seconds"]
    return out


def bench_server(name: str, command: list[str], env: dict, port: int, api_key: str, models: list[str],
                 args: argparse.Namespace) -> dict:
    from openai import OpenAI

    server = start(command, env)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=600)
        t0 = time.perf_counter()
        wait_ready(client, server, models[0])
        result = {"ready_seconds": time.perf_counter() - t0}
        measure(client, models, 1, args.max_tokens, 1)  # warm-up
        alone = measure(client, models[:1], args.clients * args.rounds, args.max_tokens, 1)["sequential"]
        return result | measure(client, models, args.clients, args.max_tokens, args.rounds) | {
            "lone_request_on_the_base": {"p50_latency_s": alone["p50_latency_s"],
                                         "completion_tokens_per_second": alone["completion_tokens_per_second"]}}
    except SystemExit as e:
        return {"error": f"{name}: {e}"}
    finally:
        stop_server(server, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    p.add_argument("--adapter", action="append", required=True, metavar="NAME=SOURCE")
    p.add_argument("--output-dir", default="outputs")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-transformers-serve", action="store_true")
    args = p.parse_args(argv)
    names = [spec.partition("=")[0] for spec in args.adapter]
    base = base_of(adapter_folder(args.adapter[0].partition("=")[2], args.output_dir)).path
    key, port = secrets.token_urlsafe(24), free_port()
    env = {**os.environ, "SERVE_API_KEY": key}
    ours = [sys.executable, "-m", "jobs.serve", "--port", str(port), "--output-dir", args.output_dir,
            "--max-batch-size", str(args.clients), *(a for spec in args.adapter for a in ("--adapter", spec))]
    report = {"clients": args.clients, "max_tokens": args.max_tokens, "base": base,
              "jobs_serve": bench_server("jobs.serve", ours, env, port, key, ["base", *names], args)}
    if not args.no_transformers_serve:
        port = free_port()
        theirs = [os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", base, "--port", str(port),
                  "--host", "127.0.0.1", "--device", "cpu"]
        report["transformers_serve"] = bench_server("transformers serve", theirs, dict(os.environ), port, "none",
                                                    [base], args)
    ours, theirs = (report.get(k, {}).get("lone_request_on_the_base", {}).get("p50_latency_s")
                    for k in ("jobs_serve", "transformers_serve"))
    if ours and theirs:
        report["lone_request_latency_ratio"] = ours / theirs
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

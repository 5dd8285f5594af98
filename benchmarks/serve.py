"""Serving under load: jobs.serve on each engine, and `vllm serve`, side by side at 1, 8 and 32 clients.

    python -m benchmarks.serve --adapter a=RUN_OR_FOLDER [--clients 1,8,32] [--rounds 2] [--engines transformers,vllm]
                               [--previous CHECKOUT] [--no-vllm-serve]

Starts each server in turn on a free loopback port, one at a time (they would share the cores): `python -m
jobs.serve --engine E` for each engine (an API key, the adapter and its base), `python -m jobs.serve` from
--previous (another checkout, e.g. a git worktree of an earlier release), and vLLM's own OpenAI server on the
base (`vllm serve`: vLLM's api_server module, every core bound, the same dtype and cache budget). On each, after
a warm-up: the closed-loop load of benchmarks/load.py (each client sends 3 streamed chat requests one after
another, long and short answers alternating, T 0.7) at each client count, to the base and, on jobs.serve, to
the adapter. The servers take turns round by round, in reverse order every other round, so a slow spell of
the machine falls on each. Prints a JSON line per measurement as it comes, then one with every figure's median
over the rounds and, at the most clients, each jobs.serve engine's tokens/s and p95 latency against `vllm
serve`'s on the base.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from app.model.hardware import has_fast_bf16, resolve_dtype
from app.tracking.adapters import adapter_folder, base_of
from benchmarks.load import Shape, run_load

PROMPTS = ["Write 347 in words.", "Write 1208 in words.", "Write 56 in words.", "Write 9021 in words."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], env: dict, cwd: str | None = None) -> subprocess.Popen:
    return subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def stop_server(server: subprocess.Popen, sig: int) -> None:
    """`sig` to the server's process group; SIGKILL if it has not ended a minute later."""
    if server.poll() is not None:  # it exited by itself (its error is reported)
        return
    os.killpg(server.pid, sig)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def wait_ready(client, server: subprocess.Popen, model: str, timeout: float = 600) -> None:
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


@dataclass
class Server:
    """A server to measure: how it starts, and the model names that ask for the base and the adapter."""

    label: str
    command: list[str]
    env: dict
    port: int
    models: dict[str, str]
    cwd: str | None = None


def servers(args: argparse.Namespace, key: str, base: str) -> list[Server]:
    name = args.adapter.partition("=")[0]
    models = {"base": "base", "adapter": name}

    def ours(label: str, flags: list[str], cwd: str | None = None) -> Server:
        port = free_port()
        env = {**os.environ, "SERVE_API_KEY": key} | ({"PYTHONPATH": cwd} if cwd else {})
        command = [sys.executable, "-m", "jobs.serve", "--port", str(port), "--output-dir",
                   os.path.abspath(args.output_dir), "--adapter", args.adapter, *flags]
        return Server(label, command, env, port, models, cwd)

    measured = [ours(f"jobs.serve --engine {engine}", ["--engine", engine]) for engine in args.engines.split(",")]
    if args.previous:
        measured.append(ours("jobs.serve (previous)", [], os.path.abspath(args.previous)))
    if not args.no_vllm_serve:
        port, cores = free_port(), os.cpu_count() or 1
        dtype = resolve_dtype("auto", has_fast_bf16(torch.device("cpu")))
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base,
                   "--host", "127.0.0.1", "--port", str(port), f"--api-key={key}", "--served-model-name", "base",
                   "--max-num-seqs", "64", "--dtype", dtype, "--kv-cache-memory-bytes", str(4 << 30),
                   "--disable-log-stats", "--seed", "0"]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
        measured.append(Server("vllm serve", command, env, port, {"base": "base"}))
    return measured


def measure(server: Server, key: str, levels: list[int], shape: Shape) -> list[dict]:
    """The load at each client count against each of the server's models (after a warm-up): a record each."""
    from openai import OpenAI

    process = start(server.command, server.env, server.cwd)
    records = []
    try:
        url = f"http://127.0.0.1:{server.port}/v1"
        wait_ready(OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600), process, server.models["base"])
        for model in server.models.values():
            run_load(url, key, model, 4, Shape(32, 8, shape.temperature, 1))  # warm-up: compiled paths, caches
        for clients in levels:
            for kind, model in server.models.items():
                figures = run_load(url, key, model, clients, shape)
                records.append({"server": server.label, "model": kind, "clients": clients} | figures)
                print(json.dumps(records[-1]), flush=True)
    except SystemExit as e:
        records.append({"server": server.label, "error": str(e)[:2000]})
        print(json.dumps(records[-1]), flush=True)
    finally:
        stop_server(process, signal.SIGINT)
    return records


FIGURES = ["generated_tokens_per_second", "requests_per_second", "p50_latency_s", "p95_latency_s",
           "p50_first_token_s", "p95_first_token_s"]


def summary(records: list[dict], levels: list[int]) -> dict:
    """Each (server, model, clients)'s median figures over the rounds, and the ratios to vllm serve's base."""
    table: dict[str, dict] = {}
    for record in (r for r in records if "error" not in r):
        row = table.setdefault(f"{record['server']} | {record['model']} | {record['clients']}", {"failed": 0})
        row["failed"] += record["failed"]
        for figure in FIGURES:
            row.setdefault(figure, []).append(record[figure])
    for row in table.values():
        for figure in FIGURES:
            values = [v for v in row[figure] if v is not None]
            row[figure] = round(statistics.median(values), 3) if values else None
    most, ratios = max(levels), {}
    peer = table.get(f"vllm serve | base | {most}")
    for label, row in table.items():
        server, model, clients = label.split(" | ")
        if peer and int(clients) == most and server != "vllm serve":
            ratios[f"{server} | {model}"] = {
                "tokens_per_second_vs_vllm_serve": round(row["generated_tokens_per_second"] /
                                                         peer["generated_tokens_per_second"], 3),
                "p95_latency_vs_vllm_serve": round(row["p95_latency_s"] / peer["p95_latency_s"], 3)}
    return {"medians": table, f"at_{most}_clients": ratios,
            "errors": [r for r in records if "error" in r]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    p.add_argument("--adapter", required=True, metavar="NAME=SOURCE", help="the adapter jobs.serve serves")
    p.add_argument("--output-dir", default="outputs")
    p.add_argument("--clients", default="1,8,32", help="client counts, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engines", default="transformers,vllm", help="jobs.serve's engines to measure")
    p.add_argument("--previous", help="another checkout whose jobs.serve is measured too")
    p.add_argument("--no-vllm-serve", action="store_true")
    p.add_argument("--long-tokens", type=int, default=160)
    p.add_argument("--short-tokens", type=int, default=8)
    args = p.parse_args(argv)
    levels = [int(n) for n in args.clients.split(",")]
    base = base_of(adapter_folder(args.adapter.partition("=")[2], args.output_dir)).path
    key, shape = secrets.token_urlsafe(24), Shape(args.long_tokens, args.short_tokens)
    measured, records = servers(args, key, base), []
    for round_ in range(args.rounds):
        for server in measured if round_ % 2 == 0 else reversed(measured):
            records += measure(server, key, levels, shape)
    print(json.dumps({"base": base, "shape": vars(shape), "rounds": args.rounds} | summary(records, levels)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

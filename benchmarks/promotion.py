"""A promotion under load: jobs.serve follows `@champion` while clients keep asking and jobs.promote moves it.

    python -m benchmarks.promotion NAME --candidate VERSION --metric TASK/METRIC [--output-dir DIR] [--clients 4]
                                   [--engine auto|transformers|vllm]

The registry (MLFLOW_TRACKING_URI, else the local store under --output-dir) must hold NAME with `@champion`
set (`python -m jobs.promote NAME --candidate 1 ...` makes the first one). Starts `python -m jobs.serve
--adapter served=models:/NAME@champion --follow-interval-s 2 --engine E`, N clients asking greedily without
pause, then runs `python -m jobs.promote` on the candidate, and keeps asking until the candidate answers (at most
--wait-s) and --after-s more. Prints one JSON line: the promotion's exit code and reason, the requests answered
and failed, how many each version answered, and the seconds from the promotion's end to the candidate's first
answer (null if it never answered).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from benchmarks.serve import PROMPTS, free_port, start, stop_server, wait_ready


def ask_until(client, stop: threading.Event, answers: list, worker: int) -> None:
    i = worker
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            reply = client.chat.completions.create(model="served", temperature=0, max_tokens=16,
                                                   messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
            answers.append((time.time(), reply.system_fingerprint, time.perf_counter() - t0, None))
        except Exception as e:  # a failed request is what this measures
            answers.append((time.time(), None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:200]))
        i += 1


def main(argv: list[str] | None = None) -> int:
    from openai import OpenAI

    p = argparse.ArgumentParser(prog="python -m benchmarks.promotion", description=__doc__.split("\n")[0])
    p.add_argument("name")
    p.add_argument("--candidate", required=True)
    p.add_argument("--metric", required=True)
    p.add_argument("--output-dir", default="outputs")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--engine", default="auto", help="jobs.serve's --engine")
    p.add_argument("--wait-s", type=float, default=600.0, help="the most to wait for the new version's first answer "
                   "after the promotion (a merged engine starts first on auto)")
    p.add_argument("--after-s", type=float, default=10.0, help="keep asking this long after the new version answers")
    args = p.parse_args(argv)
    key, port = secrets.token_urlsafe(24), free_port()
    server = start([sys.executable, "-m", "jobs.serve", "--port", str(port), "--output-dir", args.output_dir,
                    "--adapter", f"served=models:/{args.name}@champion", "--follow-interval-s", "2",
                    "--engine", args.engine],
                   {**os.environ, "SERVE_API_KEY": key})
    answers, stop = [], threading.Event()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        wait_ready(client, server, "served")
        clients = [threading.Thread(target=ask_until, args=(client, stop, answers, i)) for i in range(args.clients)]
        for thread in clients:
            thread.start()
        time.sleep(5)
        # the scoring shares this machine with the server under load: one thread, not a second OpenMP pool
        # spinning on cores the engine's is bound to (on 2 cores it took over 10 minutes)
        promotion = subprocess.run([sys.executable, "-m", "jobs.promote", args.name, "--candidate", args.candidate,
                                    "--metric", args.metric, "--output-dir", args.output_dir],
                                   capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        promoted_at, fingerprint = time.time(), f"models:/{args.name}/{args.candidate}"
        while (promotion.returncode == 0 and time.time() < promoted_at + args.wait_s
               and not any(answered_by == fingerprint for _, answered_by, _, _ in answers[-50:])):
            time.sleep(1)
        time.sleep(args.after_s)
        stop.set()
        for thread in clients:
            thread.join()
    finally:
        stop_server(server, signal.SIGINT)
    lines = promotion.stdout.strip().splitlines()
    first_new = min((t for t, answered_by, _, _ in answers if answered_by == fingerprint), default=None)
    print(json.dumps({
        "engine": args.engine, "promote_exit_code": promotion.returncode,
        "reason": lines[-2] if len(lines) > 1 else promotion.stderr[-300:],
        "requests": len(answers), "failed": sum(error is not None for *_, error in answers),
        "errors": sorted({error for *_, error in answers if error})[:3],
        "answered_by": dict(collections.Counter(fingerprint for _, fingerprint, _, _ in answers if fingerprint)),
        "seconds_to_new_version": None if first_new is None else round(first_new - promoted_at, 2),
        "p50_latency_s": sorted(latency for _, _, latency, _ in answers)[len(answers) // 2] if answers else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

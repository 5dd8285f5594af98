"""Held-out accuracy of a served model, as an OpenAI client sees it: each problem of a reasoning-gym source asked
through `/v1/chat/completions` (greedy), each answer scored by the task's own checker (app.data.gym_tasks: the
answer it gives, scored by reasoning-gym's score_answer), the mean with its standard error beside what
`jobs.evaluate` reported for the same problems.

    python -m jobs.serve --adapter champion=models:/smollm2@champion &
    python -m benchmarks.served_accuracy --model champion --source "rg://chain_sum?size=64&seed=1000&..."

Prints one JSON line: problems, accuracy, its standard error, seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from app.data.gym_tasks import score_answer, write_task_source


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.served_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the served name to ask (an adapter's, or the base's)")
    p.add_argument("--source", required=True, help="an rg:// task source: its problems are asked")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--max-tokens", type=int, default=48)
    return p.parse_args(argv)


def main(argv=None) -> None:
    from openai import OpenAI

    args = parse_args(argv)
    records = [json.loads(line) for line in write_task_source(args.source, "--source").read_text().splitlines()]
    client = OpenAI(base_url=args.url, api_key=os.environ.get("SERVE_API_KEY", "none"))
    started = time.perf_counter()
    answers = [client.chat.completions.create(model=args.model, messages=r["prompt"], temperature=0,
                                              max_tokens=args.max_tokens).choices[0].message.content for r in records]
    scores = score_answer(answers, [r["answer"] for r in records], [r["task"] for r in records],
                          [r["metadata"] for r in records])
    mean = sum(scores) / len(scores)
    stderr = math.sqrt(sum((s - mean) ** 2 for s in scores) / max(len(scores) - 1, 1) / len(scores))
    print(json.dumps({"model": args.model, "problems": len(scores), "accuracy": mean, "stderr": stderr,
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()

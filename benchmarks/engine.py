"""This project's engine alone, in process: no HTTP, no Ray, no client on the same cores.

    python -m benchmarks.engine --model PATH [--rows 1,8,32] [--max-tokens 160] [--repeats 3]

N sequences of one chat prompt, sampled at T 0.7 up to --max-tokens each (no end token: every one runs whole),
submitted at once to an EngineCore over the model (bf16 where the CPU has it natively, else fp32). Prints one
JSON line: generated tokens/s at each row count, the median of --repeats. Beside benchmarks/serve.py's figures
it splits a server's cost into the engine's and the serving path's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.engine.core import EngineCore
from app.engine.sampling import SamplingParams
from app.engine.sequence import Sequence
from app.model.hardware import has_fast_bf16, resolve_dtype

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message."}]


def tokens_per_second(core: EngineCore, prompt: list[int], rows: int, max_tokens: int) -> float:
    for seed in range(rows):
        core.add(Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.7), None, seed))
    started = time.perf_counter()
    while core.busy:
        core.step()
    return rows * max_tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model folder (or hub id)")
    p.add_argument("--rows", default="1,8,32", help="sequences at once, comma-separated")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    dtype = resolve_dtype("auto", has_fast_bf16(torch.device("cpu")))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype))
    core = EngineCore(model, [], max_rows=max(int(n) for n in args.rows.split(",")))
    prompt = tokenizer(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    tokens_per_second(core, prompt, 4, 16)  # warm-up
    figures = {rows: statistics.median(tokens_per_second(core, prompt, rows, args.max_tokens)
                                       for _ in range(args.repeats)) for rows in map(int, args.rows.split(","))}
    print(json.dumps({"model": args.model, "dtype": dtype, "threads": torch.get_num_threads(),
                      "generated_tokens_per_second": {rows: round(v, 1) for rows, v in figures.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput on data shaped like real chat data: packing against one record per row, side by side.

    python -m benchmarks.realistic --steps 8

Generates a long-tailed chat dataset (records of ~17 to ~1,000 tokens, most under 100: the shape of real
instruction data) and a random-weight model of a 100M+ shape (benchmarks/shapes/bench_125m.json, with
the embedded tokenizer), then runs, on 2 workers at sequence length 512 with the same global batch of rows:
(a) the job with packing, (a') the job with one record per row, (c) the training step alone on
synthetic full rows (benchmarks/step.py). Figures: real (non-pad) tokens per second per worker, time to
first step, peak memory per worker, and the eval loss each job reaches. A third job runs (a') with as many
rows per step as hold the real tokens of (a)'s rows: the same steps and about the same real tokens, so
its eval loss is what (a)'s compares with at an equal number of real tokens (and updates).
The compute dtype is the job's `auto` (bf16 where the CPU or GPU has bf16 units). Writes
<out>/realistic.json, a plot, and an MLflow run (experiment "benchmarks").

Not run here: (b) the seed's torchrun loop, which computes in bf16 whatever the hardware (~113 s a step
on the 125M shape at seq 128 on a CPU without bf16 units), and (p) TRL's SFTTrainer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SHAPES, last_json_line, random_checkpoint, torchrun, write_and_log

MODES = {"a_packed": "(a) job, packed", "a_prime_unpacked": "(a') job, one record per row",
         "a_prime_equal_tokens": "(a') with as many real tokens per step as (a)", "c_step_only": "(c) step only"}


def long_tailed_chats(count: int, seed: int) -> list[dict]:
    """Chats that spell out a list of numbers; the list length is log-normal, so most records are short
    and a few run to ~1,000 tokens."""
    from app.embedded import number_in_words

    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        numbers = rng.integers(0, 1000, int(np.clip(rng.lognormal(np.log(3.0), 1.2), 1, 100))).tolist()
        records.append({"messages": [
            {"role": "user", "content": "Spell out: " + ", ".join(map(str, numbers))},
            {"role": "assistant", "content": ", ".join(number_in_words(n) for n in numbers)}]})
    return records


def prepare(out: Path, records: int) -> tuple[Path, Path, Path]:
    """The random-weight model (with the embedded tokenizer) and the train and eval files, built once."""
    from transformers import AutoTokenizer

    from app.config import load_config
    from app.embedded import ensure_embedded

    cfg = load_config("jobs/configs/embedded.yaml")
    ensure_embedded(cfg)
    model = random_checkpoint(str(SHAPES / "bench_125m.json"), out)
    AutoTokenizer.from_pretrained(cfg.model.path).save_pretrained(model)
    train, evals = out / "realistic-train.jsonl", out / "realistic-eval.jsonl"
    for path, count, seed in ((train, records, 0), (evals, 64, 1)):
        if not path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in long_tailed_chats(count, seed)))
    return model, train, evals


def tokens_per_row(model: Path, train: Path, seq_len: int, open_rows: int) -> dict[str, float]:
    """Real tokens per training row, packed and not (what makes the two jobs' steps differ)."""
    from transformers import AutoTokenizer

    from app.formatting import tokenize_rows
    from app.packing import first_fit

    records = [json.loads(line) for line in train.read_text().splitlines()]
    lengths = tokenize_rows(records, AutoTokenizer.from_pretrained(model), "auto", seq_len)["length"]
    packed_rows = len(first_fit(lengths, seq_len, open_rows))
    return {"record_tokens_p50": float(np.median(lengths)), "record_tokens_p99": float(np.percentile(lengths, 99)),
            "unpacked": float(lengths.mean()), "packed": float(lengths.sum() / packed_rows)}


def run(args) -> dict:
    out = Path(args.out)
    model, train, evals = prepare(out, args.records)
    per_row = tokens_per_row(model, train, args.seq_len, 64)
    rows_for_equal_tokens = args.global_batch * max(1, round(per_row["packed"] / per_row["unpacked"]))
    common = [f"model.path={model}", f"data.train_path={train}", f"data.eval_path={evals}",
              f"data.max_seq_len={args.seq_len}", f"train.max_steps={args.steps}", "train.learning_rate=2e-4",
              "train.warmup_steps=0", "train.log_every=1", "train.sample_prompts=0", "data.max_eval_rows=16",
              f"train.checkpoint_every={args.steps}", f"train.eval_every={args.steps}"]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    settings = {"a_packed": ("true", args.global_batch, args.micro_batch),
                "a_prime_unpacked": ("false", args.global_batch, args.micro_batch),
                "a_prime_equal_tokens": ("false", rows_for_equal_tokens,
                                         math.gcd(rows_for_equal_tokens // 2, 4 * args.micro_batch))}
    jobs = {}
    for mode, (packing, rows, micro) in settings.items():
        overrides = [*common, f"data.packing={packing}", f"train.global_batch_size={rows}",
                     f"train.micro_batch_size={micro}", f"train.run_name=realistic-{mode}-{stamp}"]
        jobs[mode] = last_json_line([sys.executable, "-m", "jobs.finetune", "--config", "jobs/configs/embedded.yaml",
                                     *(a for o in overrides for a in ("--set", o))])
        jobs[mode]["tokens_per_second_per_worker"] = jobs[mode]["tokens_per_second"] / 2
        jobs[mode]["global_batch_rows"] = rows
    step = torchrun(2, "benchmarks.step", "--model-path", str(model), "--load", "full", "--steps", str(args.steps),
                    "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                    "--accum", str(args.global_batch // (2 * args.micro_batch)), "--no-activation-checkpointing",
                    "--no-reshard-after-forward")
    packed, unpacked = jobs["a_packed"], jobs["a_prime_unpacked"]
    return {"seq_len": args.seq_len, "workers": 2, "global_batch_rows": args.global_batch, "steps": args.steps,
            "real_tokens_per_row": per_row, **jobs, "c_step_only": step,
            "ratio_a_over_a_prime": packed["tokens_per_second_per_worker"] / unpacked["tokens_per_second_per_worker"],
            "ratio_a_over_c": packed["tokens_per_second_per_worker"] / step["tokens_per_second_per_worker"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    panels = {"tokens_per_second_per_worker": "real tokens/s per worker", "time_to_first_step_seconds":
              "time to first step (s)", "peak_memory_gb": "peak memory per worker (GiB)"}
    for ax, (key, label) in zip(axes, panels.items()):
        ax.bar(["a", "a'", "a' (eq. tokens)", "c"], [result[m].get(key) or 0 for m in MODES],
               color=["C0", "C1", "C3", "C2"])
        ax.set_title(label)
    fig.suptitle(f"long-tailed chat data, 125M shape, seq {result['seq_len']}, 2 workers, {result['steps']} steps  "
                 + "  ".join(MODES.values()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.realistic", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=2, help="rows per optimizer step, all workers")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--out", default="outputs/benchmark")
    args = parser.parse_args(argv)
    write_and_log(run(args), Path(args.out), "realistic", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput on data shaped like real chat data: the job packed and not, the seed's loop, TRL, side by side.

    python -m benchmarks.realistic --steps 8     # pip install -e .[bench] first (TRL)
    python -m benchmarks.realistic --model-path .cache/models/smollm2-135m-instruct \
        --modes a_auto,p_trl_defaults,a_packed,p_trl_sft --out outputs/benchmark/smollm2   # the SmolLM2 row

Generates a long-tailed chat dataset (records of ~17 to ~1,000 tokens, most under 100: the shape of real
instruction data) and a random-weight model of a 100M+ shape (benchmarks/shapes/bench_125m.json, with
the embedded tokenizer), or with --model-path a real checkpoint (the packaged SmolLM2-135M-Instruct is built on
first use) with its own tokenizer, then runs, on 2 workers at sequence length 512, with the same global batch of
rows, learning rate (constant) and LoRA:
(a) the job with packing, (a') the job with one record per row, (b) the seed's torchrun loop (one record
per row; benchmarks/baseline.py), (c) the training step alone on synthetic full rows (benchmarks/step.py),
(p) TRL's SFTTrainer with its own packing under FSDP2 (benchmarks/trl_sft.py). A further job runs (a')
with as many rows per step as hold the real tokens of (a)'s rows. Figures: real (non-pad) tokens per
second per worker, time to first step, peak memory per worker, and the eval loss (the job's measure, on
the same eval rows) after the same number of target tokens: (a) evaluates after every step, and its
curve is read at the target tokens (a') and (p) trained on.
The compute dtype is the job's `auto` (bf16 where the CPU or GPU has bf16 units), for (b) and (p) too:
the seed's loop casts to bf16 whatever the hardware, 15x slower on a CPU without bf16 units. Writes
<out>/realistic.json, a plot, and an MLflow run (experiment "benchmarks").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import AUTO_CHOICES, SHAPES, last_json_line, random_checkpoint, torchrun, write_and_log

MODES = {"a_packed": "(a) job, packed", "a_prime_unpacked": "(a') job, one record per row",
         "a_prime_equal_tokens": "(a') with as many real tokens per step as (a)", "b_seed_loop": "(b) seed loop",
         "c_step_only": "(c) step only", "p_trl_sft": "(p) TRL SFTTrainer, FSDP2",
         "a_auto": "(A) job, packed, auto choices", "p_trl_defaults": "(P) TRL SFTTrainer, its defaults"}


def long_tailed_chats(count: int, seed: int) -> list[dict]:
    """Chats that spell out a list of numbers; the list length is log-normal, so most records are short
    and a few run to ~1,000 tokens."""
    from jobs.embedded import number_in_words

    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        numbers = rng.integers(0, 1000, int(np.clip(rng.lognormal(np.log(3.0), 1.2), 1, 100))).tolist()
        records.append({"messages": [
            {"role": "user", "content": "Spell out: " + ", ".join(map(str, numbers))},
            {"role": "assistant", "content": ", ".join(number_in_words(n) for n in numbers)}]})
    return records


def prepare(out: Path, records: int, model_path: str | None = None) -> tuple[Path, Path, Path]:
    """The model (given, or the random-weight shape with the embedded tokenizer) and the train and eval files,
    built once."""
    from transformers import AutoTokenizer

    from app.config.loading import load_config
    from app.model.packaged import ensure_packaged
    from jobs.embedded import ensure_embedded

    out.mkdir(parents=True, exist_ok=True)
    if model_path:
        ensure_packaged(model_path)
        model = Path(model_path)
    else:
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

    from app.data.formatting import tokenize_rows
    from app.data.packing import first_fit

    records = [json.loads(line) for line in train.read_text().splitlines()]
    lengths = tokenize_rows(records, AutoTokenizer.from_pretrained(model), "auto", seq_len)["length"]
    packed_rows = len(first_fit(lengths, seq_len, open_rows))
    return {"record_tokens_p50": float(np.median(lengths)), "record_tokens_p99": float(np.percentile(lengths, 99)),
            "unpacked": float(lengths.mean()), "packed": float(lengths.sum() / packed_rows)}


def job(overrides: list[str]) -> dict:
    """One run of the job; its summary with the curves the comparison needs, read back from MLflow."""
    from mlflow.tracking import MlflowClient

    summary = last_json_line([sys.executable, "-m", "jobs.finetune", "--config", "jobs/configs/embedded.yaml",
                              *(a for o in overrides for a in ("--set", o))])
    client = MlflowClient(summary["tracking_uri"])
    curve = lambda name: {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], name)}
    targets = curve("step_target_tokens")
    summary["target_tokens_per_step"] = [targets[step] for step in sorted(targets)]
    summary["eval_loss_by_step"] = curve("eval_loss")
    summary["tokens_per_second_per_worker"] = summary["tokens_per_second"] / 2
    return summary


def eval_loss_at(curve: dict, target_tokens_per_step: list[float], target_tokens: float) -> float | None:
    """The eval loss a run had reached after `target_tokens` target tokens (linear between its evaluations;
    None beyond its last one)."""
    seen = np.concatenate([[0.0], np.cumsum(target_tokens_per_step)])
    steps = sorted(curve)
    if target_tokens > seen[steps[-1]]:
        return None
    return float(np.interp(target_tokens, [seen[s] for s in steps], [curve[s] for s in steps]))


def eval_loss_comparison(job_run: dict, other: dict, mode: str) -> dict:
    """The other mode's final eval loss and the job's at the same target tokens (read on its curve)."""
    tokens = sum(other["target_tokens_per_step"])
    at = eval_loss_at(job_run["eval_loss_by_step"], job_run["target_tokens_per_step"], tokens)
    return {"target_tokens": tokens, mode: other["final_eval_loss"], "job": at}


def run(args) -> dict:
    from app.model.hardware import has_fast_bf16

    out = Path(args.out)
    model, train, evals = prepare(out, args.records, args.model_path)
    per_row = tokens_per_row(model, train, args.seq_len, 64)
    rows_for_equal_tokens = args.global_batch * max(1, round(per_row["packed"] / per_row["unpacked"]))
    common = [f"model.path={model}", f"data.train_path={train}", f"data.eval_path={evals}",
              f"data.max_seq_len={args.seq_len}", "train.learning_rate=2e-4", "train.lr_schedule=constant",
              "train.warmup_steps=0", "train.log_every=1", "train.sample_prompts=0", "data.max_eval_rows=16",
              "fsdp.reshard_after_forward=true",  # FSDP's default, the seed's and TRL's: memory compares
              "eval.generation_rows=0", "train.best_metric=eval_loss"]  # no task metric on random weights
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # (a) runs half as many steps again, evaluating after each (a constant rate: its first steps are the
    # same), so its eval loss can be read at the target tokens the others reached
    steps_a = math.ceil(1.5 * args.steps)
    matched = ["model.gradient_checkpointing=false", "model.compile=false",  # the settings the others run with
               f"train.micro_batch_size={args.micro_batch}"]
    settings = {"a_packed": ("true", args.global_batch, matched, steps_a, 1),
                "a_auto": ("true", args.global_batch, AUTO_CHOICES, steps_a, 1),  # (A): what the job picks for itself
                "a_prime_unpacked": ("false", args.global_batch, matched, args.steps, args.steps),
                "a_prime_equal_tokens": ("false", rows_for_equal_tokens, [
                    "model.gradient_checkpointing=false", "model.compile=false",
                    f"train.micro_batch_size={math.gcd(rows_for_equal_tokens // 2, 4 * args.micro_batch)}"],
                    args.steps, args.steps)}
    result = {"model": str(model), "seq_len": args.seq_len, "workers": 2, "global_batch_rows": args.global_batch,
              "steps": args.steps,
              "dtype": "bfloat16" if has_fast_bf16(__import__("torch").device("cpu")) else "float32",
              "real_tokens_per_row": per_row, "modes": args.modes}
    for mode, (packing, rows, choices, steps, eval_every) in settings.items():
        if mode not in args.modes:
            continue
        result[mode] = job([*common, *choices, f"data.packing={packing}", f"train.global_batch_size={rows}",
                            f"train.max_steps={steps}", f"train.eval_every={eval_every}",
                            f"train.checkpoint_every={steps}", f"train.run_name=realistic-{mode}-{stamp}",
                            *args.set])  # the caller's last: one setting A/B'd on the same data and model
        result[mode]["global_batch_rows"] = rows
    warmup = str(min(2, args.steps - 1))  # steps left out of the torchrun modes' throughput
    for mode, command in torchrun_modes(args, model, train, evals, out, result["dtype"], warmup).items():
        if mode in args.modes:
            result[mode] = torchrun(2, *command)
    speed = lambda mode: result[mode]["tokens_per_second_per_worker"]
    comparisons = {"a_packed": ("a_prime_unpacked", "b_seed_loop", "c_step_only", "p_trl_sft"),
                   "a_auto": ("p_trl_defaults", "p_trl_sft", "a_packed")}
    for job_mode, others in [(mode, others) for mode, others in comparisons.items() if mode in result]:
        result[f"real_tokens_per_second_{job_mode}_over"] = {m: speed(job_mode) / speed(m) for m in others
                                                             if m in result}
        for mode in [m for m in ("a_prime_equal_tokens", "p_trl_sft", "p_trl_defaults") if m in result]:
            result[f"eval_loss_{job_mode}_vs_{mode}"] = eval_loss_comparison(result[job_mode], result[mode], mode)
    return result


def torchrun_modes(args, model: Path, train: Path, evals: Path, out: Path, dtype: str, warmup: str) -> dict:
    """(b), (c), (p) and (P): the modes that run under torchrun, as module and flags."""
    trl = ["benchmarks.trl_sft", "--model-path", str(model), "--train", str(train), "--eval", str(evals),
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.global_batch // 2), "--steps", str(args.steps),
           "--warmup", warmup]
    return {"b_seed_loop": ["benchmarks.baseline", "--model-path", str(model), "--data", str(train),
                            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                            "--global-batch", str(args.global_batch), "--steps", str(args.steps),
                            "--dtype", dtype, "--warmup", warmup],
            "c_step_only": ["benchmarks.step", "--model-path", str(model), "--load", "full", "--steps", str(args.steps),
                            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                            "--accum", str(args.global_batch // (2 * args.micro_batch)),
                            "--no-activation-checkpointing", "--warmup", warmup],
            "p_trl_sft": [*trl, "--out", str(out / "trl")],
            "p_trl_defaults": [*trl, "--out", str(out / "trl-defaults"), "--trl-defaults"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    panels = {"tokens_per_second_per_worker": "real tokens/s per worker", "time_to_first_step_seconds":
              "time to first step (s)", "peak_memory_gb": "peak memory per worker (GiB)"}
    for ax, (key, label) in zip(axes, panels.items()):
        shown = [m for m in MODES if m in result]
        ax.bar([MODES[m].split(" ")[0] for m in shown], [result[m].get(key) or 0 for m in shown],
               color=[f"C{i}" for i in range(len(shown))])
        ax.set_title(label)
    fig.suptitle(f"long-tailed chat data, {Path(result['model']).name}, seq {result['seq_len']}, 2 workers, "
                 f"{result['steps']} steps  "
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
    parser.add_argument("--model-path", help="a checkpoint folder (default: the 125M shape, random weights)")
    parser.add_argument("--out", default="outputs/benchmark")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for the job's modes, after the benchmark's own (repeatable)")
    args = parser.parse_args(argv)
    write_and_log(run(args), Path(args.out), "realistic", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

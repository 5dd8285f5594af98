"""SFT side by side on a task: the job (its config as given) against TRL's SFTTrainer with PEFT LoRA under FSDP2,
on the same chats, scored by the same held-out answers.

    python -m benchmarks.sft_side_by_side --config jobs/configs/smollm2_sft.yaml

Both sides take from the config (after any --set): the model (a GGUF or the packaged model resolved to its
folder), the train and held-out chats (a reasoning-gym source generated once, the held-out problems left out of
the train ones), the LoRA rank (alpha 2r, all-linear), the learning rate (constant, no warm-up on both), the
sequence length, the rows per optimizer step (TRL: that many packed rows per step, half on each worker, no
accumulation) and the steps. Each side packs its own way (the job's first-fit rows, TRL's best-fit decreasing
padding-free rows). Figures per side: real tokens per second per worker in the steady state (the first --warmup
steps left out), peak memory per worker, and the mean of each --reward over the held-out problems answered
greedily by the saved adapter in plain transformers + PEFT (benchmarks/exact_match.py), with the base model's
beside them. Prints one JSON line and writes <out>/sft_side_by_side.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from app.config.loading import load_config
from app.launch.inputs import plan_files
from benchmarks.common import report_side_by_side, run_job_steadily, torchrun
from benchmarks.exact_match import held_out_rewards
from jobs.embedded import ensure_embedded

T_START = time.perf_counter()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sft_side_by_side", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="jobs/configs/smollm2_sft.yaml", help="an SFT config both sides follow")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--reward", action="append", help="a reward function scoring the held-out answers (repeatable; "
                   "default: app.data.gym_tasks:score_answer)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--out", default="outputs/benchmark/sft")
    return p.parse_args(argv)


def run_job(args, cfg) -> dict:
    """The job, with its steady real tokens/s per worker (from its MLflow steps)."""
    steps = cfg.train.max_steps
    bench = ["train.lr_schedule=constant", "train.warmup_steps=0", "train.eval_on_start=false",
             f"train.eval_every={steps}", f"train.checkpoint_every={steps}", "train.log_every=1",
             "train.sample_prompts=0", f"train.output_dir={Path(args.out).resolve() / 'job'}",
             f"train.run_name=sft-side-by-side-{time.strftime('%Y%m%d-%H%M%S')}"]
    summary, curve, steady, seconds = run_job_steadily(args.config, [*args.set, *bench], args.warmup)
    tokens = curve("step_tokens")
    return {"tokens_per_second_per_worker": sum(tokens[s] for s in steady) / seconds / cfg.scaling.num_workers,
            "step_seconds_steady": seconds / len(steady), "peak_memory_gb": summary["peak_memory_gb"],
            "time_to_first_step_seconds": summary.get("time_to_first_step_seconds"),
            "final_eval_loss": summary["final_eval_loss"], "adapter": summary["adapter_path"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    ensure_embedded(cfg)
    plan, sources = plan_files(cfg)
    cfg = plan.cfg
    train, workers = cfg.train, cfg.scaling.num_workers
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"config": args.config, "overrides": args.set, "model": cfg.model.path, "steps": train.max_steps,
              "rows_per_step": train.global_batch_size, "seq_len": cfg.data.max_seq_len, "workers": workers,
              "job": run_job(args, cfg)}
    result["trl"] = torchrun(workers, "benchmarks.trl_sft", "--model-path", cfg.model.path,
                             "--train", sources.train[0].files[0], "--eval", sources.eval.files[0],
                             "--seq-len", str(cfg.data.max_seq_len), "--micro-batch",
                             str(train.global_batch_size // workers), "--steps", str(train.max_steps),
                             "--warmup", str(args.warmup), "--lr", str(train.learning_rate),
                             "--lora-r", str(cfg.lora.r), "--out", str(Path(args.out) / "trl"))
    rewards = args.reward or ["app.data.gym_tasks:score_answer"]
    score = lambda adapter: {f"held_out_{k}": v for k, v in held_out_rewards(
        cfg.model.path, adapter, sources.eval.files[0], rewards, cfg.eval.max_new_tokens).items() if k != "adapter"}
    result["start"] = score(None)
    for side in ("job", "trl"):
        result[side] |= score(result[side]["adapter"])
    result["seconds"] = time.perf_counter() - T_START
    return report_side_by_side(result, "tokens_per_second_per_worker", Path(args.out, "sft_side_by_side.json"))


if __name__ == "__main__":
    sys.exit(main())

"""DPO side by side: the job (`train.objective=dpo`) against TRL's DPOTrainer with PEFT LoRA under FSDP2.

    python -m benchmarks.trl_dpo --steps 8 --seq-len 256 --global-batch 4 --micro-batch 1   # 125M shape
    python -m benchmarks.trl_dpo --model-path .cache/embedded/model \\
        --train .cache/embedded/data/preference_train.jsonl --eval .cache/embedded/data/preference_eval.jsonl \\
        --steps 60 --global-batch 32 --micro-batch 16 \\
        --lr 2e-3 --beta 0.25 --seq-len 32

Without --model-path: a random-weight model of the 125M Llama shape (benchmarks/shapes/bench_125m.json,
with the embedded tokenizer) and generated pairs of long-tailed lengths (benchmarks/realistic.py's chats:
the prompt is the user turn, chosen its right answer, rejected the same answer with one number spelled
one off, so both answers have about the same length); 64 held-out pairs from another seed. Throughput and
memory mean something there, reward accuracy does not (random weights): give --model-path with real pairs
(the embedded model's) for that.

Both sides, on 2 CPU workers: the same LoRA (r, alpha = 2r, all-linear, dropout 0), beta, sigmoid loss,
steps, pairs per optimizer step (global batch), pairs per forward (micro batch), learning rate (constant,
no warm-up), gradient clipping 1.0, max length (prompt + answer) and compute dtype (bf16 where the CPU has
bf16 units). The reference is the base with the adapter disabled on both sides. TRL runs under torchrun
with gloo, `fsdp_config` version 2 (each decoder layer `fully_shard`ed via accelerate, as
benchmarks/trl_sft.py does) and TRL's own chat-template tokenization and padding.
With --defaults each side runs as its users run it instead: the job with its `auto` choices (checkpointing,
compile and micro-batch from the plan), TRL with its defaults (activation checkpointing on).
Figures per side: pairs per second per worker in the steady state (the first --warmup steps left out;
the job's step times are read back from its MLflow step metrics), peak memory per worker (resident memory,
app/train/progress.py's measure, the max over workers), and the held-out reward accuracy of the saved
adapter, computed for both by benchmarks/reward_accuracy.py (plain transformers + PEFT). Prints one JSON
line and writes <out>/trl_dpo.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T_START = time.perf_counter()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trl_dpo", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", help="a checkpoint with its tokenizer; default: the 125M shape, random weights")
    p.add_argument("--train", help="JSONL pairs {prompt, chosen, rejected}; default: generated")
    p.add_argument("--eval", help="held-out JSONL pairs; default: generated")
    p.add_argument("--seq-len", type=int, default=256, help="max tokens of prompt + one answer")
    p.add_argument("--micro-batch", type=int, default=1, help="pairs per forward per worker")
    p.add_argument("--global-batch", type=int, default=4, help="pairs per optimizer step, all workers")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--pairs", type=int, default=2000, help="generated training pairs")
    p.add_argument("--eval-pairs", type=int, default=0, help="held-out pairs scored (0: all)")
    p.add_argument("--out", default="outputs/benchmark/dpo")
    p.add_argument("--defaults", action="store_true", help="each side as its users run it: the job's auto choices "
                   "(checkpointing, compile, micro-batch), TRL's defaults (checkpointing on); else matched settings")
    p.add_argument("--trl-defaults", action="store_true", help=argparse.SUPPRESS)  # TRL's side of --defaults
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)  # the torchrun side
    return p.parse_args(argv)


def long_tailed_pairs(count: int, seed: int) -> list[dict]:
    """realistic.py's chats as pairs: rejected spells one of the numbers one off (a near miss)."""
    import numpy as np

    from benchmarks.realistic import long_tailed_chats
    from jobs.embedded import number_in_words

    rng = np.random.default_rng(seed + 100)
    pairs = []
    for chat in long_tailed_chats(count, seed):
        user, answer = (m["content"] for m in chat["messages"])
        numbers = [int(n) for n in user.removeprefix("Spell out: ").split(", ")]
        wrong = list(numbers)
        i = int(rng.integers(len(wrong)))
        wrong[i] = (wrong[i] + 1) % 1000
        pairs.append({"prompt": user, "chosen": answer,
                      "rejected": ", ".join(number_in_words(n) for n in wrong)})
    return pairs


def prepare(args) -> tuple[str, str, str]:
    """The model, train and eval paths: given, or the 125M random-weight shape and generated pairs."""
    from transformers import AutoTokenizer

    from app.config.loading import load_config
    from benchmarks.common import SHAPES, random_checkpoint
    from jobs.embedded import ensure_embedded

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model_path
    if model is None:
        cfg = load_config("jobs/configs/embedded.yaml")
        ensure_embedded(cfg)
        model = random_checkpoint(str(SHAPES / "bench_125m.json"), out)
        AutoTokenizer.from_pretrained(cfg.model.path).save_pretrained(model)
    paths = []
    for given, name, count, seed in ((args.train, "train", args.pairs, 0), (args.eval, "eval", 64, 1)):
        path = Path(given or out / f"pairs-{name}.jsonl")
        if not path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in long_tailed_pairs(count, seed)))
        paths.append(str(path))
    return str(model), *paths


def run_job(args, model: str, train: str, evals: str) -> dict:
    """The job, with its steady pairs/s per worker over the same steps as TRL's (from its MLflow steps)."""
    from benchmarks.common import AUTO_CHOICES, run_job_steadily

    overrides = [f"model.path={model}", f"data.train_path={train}", f"data.eval_path={evals}",
                 f"data.max_seq_len={args.seq_len}", f"train.max_steps={args.steps}",
                 f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.learning_rate={args.lr}", "train.lr_schedule=constant", "train.warmup_steps=0",
                 "train.log_every=1", f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}",
                 "train.sample_prompts=0", "eval.generation_rows=0", "fsdp.reshard_after_forward=true",
                 "scaling.num_workers=2", f"dpo.beta={args.beta}", "dpo.loss_type=sigmoid", f"lora.r={args.lora_r}",
                 f"lora.alpha={2 * args.lora_r}", "lora.dropout=0.0", "lora.target_modules=all-linear",
                 f"train.run_name=trl-dpo-job-{time.strftime('%Y%m%d-%H%M%S')}",
                 *(AUTO_CHOICES if args.defaults else ["model.gradient_checkpointing=false", "model.compile=false"])]
    summary, curve, steady, seconds = run_job_steadily("jobs/configs/embedded_dpo.yaml", overrides, args.warmup)
    pairs = curve("step_pairs")
    return {"pairs_per_second_per_worker": sum(pairs[s] for s in steady) / seconds / 2,
            "step_seconds_steady": seconds / len(steady), "peak_memory_gb": summary["peak_memory_gb"],
            "time_to_first_step_seconds": summary.get("time_to_first_step_seconds"),
            "job_final_eval_rewards_accuracies": summary.get("final_eval_rewards/accuracies"),
            "adapter": summary["adapter_path"], "summary": summary}


def trl_worker(args) -> None:
    """Under torchrun: DPOTrainer, timed per step; the adapter gathered and saved by rank 0."""
    import torch.distributed as dist
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from benchmarks.reward_accuracy import messages
    from benchmarks.trl_sft import (
        fsdp_on_cpu,
        lora_config,
        saved_figures,
        train_timed,
        trainer_arguments,
        trl_worker_start,
    )

    rank, world, bf16, tokenizer, model, layer_class = trl_worker_start(args.model_path)
    records = [dict(zip(("prompt", "chosen", "rejected"), messages(json.loads(line))))
               for line in open(args.train) if line.strip()]
    accum = args.global_batch // (world * args.micro_batch)
    config = DPOConfig(**trainer_arguments(args, layer_class, bf16), max_length=args.seq_len,
                       gradient_accumulation_steps=accum,
                       beta=args.beta, loss_type=["sigmoid"])
    trainer = fsdp_on_cpu(DPOTrainer)(model=model, args=config, train_dataset=Dataset.from_list(records),
                                      processing_class=tokenizer, peft_config=lora_config(args.lora_r))
    timed = train_timed(trainer, args.warmup)
    if rank == 0:
        figures = saved_figures(timed, tokenizer, args.out, args.global_batch, "pairs", world, bf16)
        figures["time_to_first_step_seconds"] = figures.pop("first_step_end") - T_START
        figures["trl_last_rewards_accuracies"] = [h["rewards/accuracies"] for h in trainer.state.log_history
                                                  if "rewards/accuracies" in h][-1]
        print(json.dumps(figures), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    from benchmarks.common import report_side_by_side, torchrun
    from benchmarks.reward_accuracy import reward_accuracy

    model, train, evals = prepare(args)
    result = {"model": model, "seq_len": args.seq_len, "steps": args.steps, "warmup_steps": args.warmup,
              "global_batch_pairs": args.global_batch, "micro_batch_pairs": args.micro_batch, "lr": args.lr,
              "beta": args.beta, "lora_r": args.lora_r, "workers": 2,
              "settings": "each side's defaults" if args.defaults else "matched"}
    result["job"] = run_job(args, model, train, evals)
    flags = ["--model-path", model, "--train", train, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
             "--micro-batch", str(args.micro_batch), "--global-batch", str(args.global_batch),
             "--warmup", str(args.warmup), "--lr", str(args.lr), "--beta", str(args.beta),
             "--lora-r", str(args.lora_r), "--out", str(Path(args.out) / "trl"), "--trl-worker",
             *(["--trl-defaults"] if args.defaults else [])]
    result["trl"] = torchrun(2, "benchmarks.trl_dpo", *flags)
    for side in ("job", "trl"):
        held_out = reward_accuracy(model, result[side]["adapter"], evals, args.beta, args.eval_pairs)
        result[side]["held_out_reward_accuracy"] = held_out["reward_accuracy"]
        result[side]["held_out_reward_margin"] = held_out["reward_margin"]
        result[side]["held_out_pairs"] = held_out["pairs"]
    result["job"].pop("summary")
    return report_side_by_side(result, "pairs_per_second_per_worker", Path(args.out, "trl_dpo.json"))


if __name__ == "__main__":
    sys.exit(main())

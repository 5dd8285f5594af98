"""GRPO side by side: the job (`train.objective=grpo`, rollouts in a Ray actor, adapter-only sync) against TRL's
GRPOTrainer with PEFT LoRA and its own generation (no vLLM), both from the same SFT adapter.

    python -m jobs.finetune --config jobs/configs/embedded.yaml --set train.run_name=numbers-sft
    python -m benchmarks.trl_grpo --adapter outputs/numbers-sft/adapter --steps 150

Both sides, on 2 CPU workers: the embedded model and its prompts (grpo_train.jsonl; held out: grpo_eval.jsonl),
the same reward file (jobs/rewards.py, unchanged: TRL's signature) and weights, cut-off answers masked, group size,
completion length, temperature, completions per optimizer step and per forward, learning rate (constant), beta,
loss type, steps, and the starting adapter (loaded trainable on TRL's side). TRL runs under torchrun with gloo and
FSDP2 via accelerate (benchmarks/trl_sft.py's setup). Figures per side: completions per second per worker in the
steady state (the first --warmup steps left out), peak memory per worker (the max over workers), and the held-out
exact match and words-in-place reward of the saved adapter, decoded greedily by plain PEFT
(benchmarks/exact_match.py), with the starting adapter's beside them. Prints one JSON line and writes
<out>/trl_grpo.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T_START = time.perf_counter()
DATA = Path(".cache/embedded/data")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trl_grpo", description=__doc__.split("\n")[0])
    p.add_argument("--adapter", required=True, help="the SFT adapter both sides start from")
    p.add_argument("--model-path", default=".cache/embedded/model")
    p.add_argument("--train", default=str(DATA / "grpo_train.jsonl"))
    p.add_argument("--eval", default=str(DATA / "grpo_eval.jsonl"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--global-batch", type=int, default=128, help="completions per optimizer step, all workers")
    p.add_argument("--micro-batch", type=int, default=32, help="completions per forward per worker")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--reward-weights", type=float, nargs=2, default=[1.0, 0.25], metavar=("EXACT", "IN_PLACE"))
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--out", default="outputs/benchmark/grpo")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)  # the torchrun side
    return p.parse_args(argv)


def run_job(args) -> dict:
    """The job, with its steady completions/s per worker over the same steps as TRL's (from its MLflow steps)."""
    from benchmarks.common import run_job_steadily

    overrides = [f"model.path={args.model_path}", f"model.init_adapter={args.adapter}", f"data.train_path={args.train}",
                 f"data.eval_path={args.eval}", f"train.max_steps={args.steps}",
                 f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.learning_rate={args.lr}", "train.lr_schedule=constant", "train.warmup_steps=0",
                 "train.log_every=1", f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}",
                 "train.eval_on_start=false", f"grpo.num_generations={args.generations}",
                 f"grpo.max_completion_tokens={args.completion_tokens}", f"grpo.temperature={args.temperature}",
                 f"grpo.beta={args.beta}", f"grpo.loss_type={args.loss_type}", "scaling.num_workers=2",
                 f"grpo.reward_weights={list(args.reward_weights)}", "grpo.mask_truncated_completions=true",
                 f"train.output_dir={Path(args.out).resolve() / 'job'}",
                 f"train.run_name=trl-grpo-job-{time.strftime('%Y%m%d-%H%M%S')}"]
    summary, curve, steady, seconds = run_job_steadily("jobs/configs/embedded_grpo.yaml", overrides, args.warmup)
    generate = curve("rollout/generate_share")
    return {"completions_per_second_per_worker": args.global_batch * len(steady) / seconds / 2,
            "step_seconds_steady": seconds / len(steady), "peak_memory_gb": summary["peak_memory_gb"],
            "generate_share": sum(generate[s] for s in steady) / len(steady),
            "sync_bytes_per_step": max(curve("rollout/sync_bytes").values(), default=0.0),
            "adapter": summary["adapter_path"]}


def trl_worker(args) -> None:
    """Under torchrun: GRPOTrainer over the SFT adapter (trainable), timed per step; rank 0 saves the adapter."""
    import torch.distributed as dist
    from datasets import Dataset
    from peft import PeftModel
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.trl_sft import fsdp_on_cpu, saved_figures, train_timed, trainer_arguments, trl_worker_start
    from jobs.rewards import exact_words, words_in_place

    rank, world, bf16, tokenizer, model, layer_class = trl_worker_start(args.model_path)
    model = PeftModel.from_pretrained(model, args.adapter, is_trainable=True)
    records = [json.loads(line) for line in open(args.train) if line.strip()]
    accum = args.global_batch // (world * args.micro_batch)
    config = GRPOConfig(**trainer_arguments(args, layer_class, bf16), gradient_accumulation_steps=accum,
                        num_generations=args.generations, max_completion_length=args.completion_tokens,
                        temperature=args.temperature, top_p=1.0, beta=args.beta, loss_type=args.loss_type,
                        scale_rewards="group", num_iterations=1, reward_weights=args.reward_weights,
                        mask_truncated_completions=True)
    trainer = fsdp_on_cpu(GRPOTrainer)(model=model, args=config, train_dataset=Dataset.from_list(records),
                                       reward_funcs=[exact_words, words_in_place], processing_class=tokenizer)
    timed = train_timed(trainer, args.warmup)
    if rank == 0:
        figures = saved_figures(timed, tokenizer, args.out, args.global_batch, "completions", world, bf16)
        print(json.dumps(figures), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    from benchmarks.common import report_side_by_side, torchrun
    from benchmarks.exact_match import exact_match

    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {key: getattr(args, key) for key in ("steps", "warmup", "global_batch", "micro_batch", "generations",
                                                  "completion_tokens", "temperature", "lr", "reward_weights", "beta",
                                                  "loss_type")}
    result["job"] = run_job(args)
    flags = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in (
        "adapter", "model_path", "train", "steps", "warmup", "global_batch", "micro_batch", "generations",
        "completion_tokens", "temperature", "lr", "beta", "loss_type")] + ["--reward-weights",
                                                                          *map(str, args.reward_weights)]
    result["trl"] = torchrun(2, "benchmarks.trl_grpo", *flags, "--out", str(Path(args.out) / "trl"), "--trl-worker")
    result["start"] = exact_match(args.model_path, args.adapter, args.eval)
    for side in ("job", "trl"):
        result[side] |= {f"held_out_{k}": v for k, v in exact_match(args.model_path, result[side]["adapter"],
                                                                       args.eval).items() if k != "adapter"}
    return report_side_by_side(result, "completions_per_second_per_worker", Path(args.out, "trl_grpo.json"))


if __name__ == "__main__":
    sys.exit(main())

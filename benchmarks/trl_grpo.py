"""GRPO side by side: the job (`train.objective=grpo`, rollouts in a Ray actor, adapter-only sync) against TRL's
GRPOTrainer with PEFT LoRA and its own generation (no vLLM), both from one GRPO config.

    python -m benchmarks.trl_grpo --config jobs/configs/smollm2_grpo.yaml --steps 15 [--staleness 0 1]
        [--engines transformers vllm]
    python -m jobs.finetune --config jobs/configs/embedded.yaml --set train.run_name=numbers-sft
    python -m benchmarks.trl_grpo --config jobs/configs/embedded_grpo.yaml --adapter outputs/numbers-sft/adapter

Both sides take from the config (after any --set): the model (a GGUF or the packaged model resolved to its folder
as the job resolves it), the train and held-out prompts (a reasoning-gym source generated once, the held-out
problems left out of the train ones), the reward functions and weights (TRL's signature, unchanged), LoRA (or the
starting --adapter, trainable on TRL's side), group size, completion length, temperature, completions per
optimizer step and per forward, learning rate (constant), beta, loss type, cut-off answers masked, and steps. TRL
runs under torchrun with gloo and FSDP2 via accelerate (benchmarks/trl_sft.py's setup), on as many workers as the
job. Figures per side: completions per second per worker in the steady state (the first --warmup steps left out),
peak memory per worker (the max over workers), and each reward function's mean over the held-out prompts answered
greedily by the saved adapter in plain PEFT (benchmarks/exact_match.py), with the start's beside them. With
--staleness the job runs once per rollout.max_staleness given (k > 0 with importance_correction tis), and with
--engines once per rollout engine (`--engines transformers vllm`: this project's loop and vLLM, each from its own
actors), each beside TRL (`jobs`; `job` is the first); each job's sampler-vs-trainer log-prob gap (mean over its
steps, and the largest) and its whole command's seconds come with it. Prints one JSON line and writes
<out>/trl_grpo.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from app.config.loading import load_config
from app.launch.inputs import plan_files
from jobs.embedded import ensure_embedded

T_START = time.perf_counter()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trl_grpo", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="jobs/configs/embedded_grpo.yaml", help="a GRPO config both sides follow")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--adapter", help="an adapter both sides start from (default: a fresh LoRA from `lora:`)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the config's train.max_steps)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--staleness", type=int, nargs="+", help="the job once per rollout.max_staleness (default: the "
                   "config's); k > 0 with rollout.importance_correction=tis")
    p.add_argument("--engines", nargs="+", choices=["transformers", "vllm"], help="the job once per rollout.engine "
                   "(default: the config's), each with every --staleness")
    p.add_argument("--out", default="outputs/benchmark/grpo")
    p.add_argument("--model-path", help=argparse.SUPPRESS)  # the torchrun side: the resolved model folder
    p.add_argument("--train-file", help=argparse.SUPPRESS)  # the torchrun side: the resolved train prompts
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)  # the torchrun side
    return p.parse_args(argv)


def overrides(args) -> list[str]:
    """--set, the steps and the starting adapter, as config overrides both sides apply."""
    extra = [f"train.max_steps={args.steps}"] if args.steps else []
    return [*args.set, *extra, *([f"model.init_adapter={args.adapter}"] if args.adapter else [])]


def run_job(args, cfg, sets: list[str], name: str = "trl-grpo-job") -> dict:
    """The job, with its steady completions/s per worker over the same steps as TRL's (from its MLflow steps), and
    the share of its steps the trainers waited for the rollout side."""
    from benchmarks.common import run_job_steadily

    steps = cfg.train.max_steps
    bench = [f"train.eval_every={steps}", f"train.checkpoint_every={steps}", "train.eval_on_start=false",
             "train.log_every=1", f"train.output_dir={Path(args.out).resolve() / 'job'}",
             f"train.run_name={name}-{time.strftime('%Y%m%d-%H%M%S')}"]
    summary, curve, steady, seconds = run_job_steadily(args.config, sets + bench, args.warmup)
    generate, idle = curve("rollout/generate_share"), curve("rollout/trainer_idle_share")
    gaps = curve("sampling/sampling_logp_difference/mean")  # every step's: the sampler against the trainer
    workers = cfg.scaling.num_workers
    return {"completions_per_second_per_worker": cfg.train.global_batch_size * len(steady) / seconds / workers,
            "step_seconds_steady": seconds / len(steady), "peak_memory_gb": summary["peak_memory_gb"],
            "generate_share": sum(generate[s] for s in steady) / len(steady),
            "trainer_idle_share": sum(idle[s] for s in steady) / len(steady),
            "staleness_mean": sum(curve("rollout/staleness_mean")[s] for s in steady) / len(steady),
            "sync_bytes_per_step": max(curve("rollout/sync_bytes").values(), default=0.0),
            "sampler_gap_mean": sum(gaps.values()) / max(len(gaps), 1),
            "sampler_gap_max": max(curve("sampling/sampling_logp_difference/max").values(), default=0.0),
            "whole_command_seconds": summary.get("wall_seconds"), "adapter": summary["adapter_path"]}


def staleness_overrides(k: int) -> list[str]:
    return [f"rollout.max_staleness={k}", f"rollout.importance_correction={'tis' if k else 'none'}"]


def trl_worker(args) -> None:
    """Under torchrun: GRPOTrainer over the config's LoRA (or the starting adapter, trainable), timed per step;
    rank 0 saves the adapter."""
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model
    from trl import GRPOConfig, GRPOTrainer

    from app.train.rewards import load_reward_function
    from benchmarks.trl_sft import fsdp_on_cpu, trainer_arguments, trl_worker_start

    cfg = load_config(args.config, overrides(args))
    train, grpo, rollout, lora = cfg.train, cfg.grpo, cfg.rollout, cfg.lora
    rank, world, bf16, tokenizer, model, layer_class = trl_worker_start(args.model_path)
    model = (PeftModel.from_pretrained(model, args.adapter, is_trainable=True) if args.adapter else get_peft_model(
        model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules, task_type="CAUSAL_LM")))
    records = [json.loads(line) for line in open(args.train_file) if line.strip()]
    shape = argparse.Namespace(out=args.out, steps=train.max_steps, micro_batch=train.micro_batch_size,
                               lr=train.learning_rate)
    config = GRPOConfig(**trainer_arguments(shape, layer_class, bf16),
                        gradient_accumulation_steps=train.global_batch_size // (world * train.micro_batch_size),
                        num_generations=rollout.num_generations, max_completion_length=rollout.max_completion_tokens,
                        temperature=rollout.temperature, top_p=1.0, beta=grpo.beta, loss_type=grpo.loss_type,
                        scale_rewards="group", num_iterations=1, reward_weights=grpo.reward_weights,
                        mask_truncated_completions=grpo.mask_truncated_completions)
    trainer = fsdp_on_cpu(GRPOTrainer)(
        model=model, args=config, train_dataset=Dataset.from_list(records), processing_class=tokenizer,
        reward_funcs=[load_reward_function(spec) for spec in grpo.reward_funcs])
    trained_and_reported(trainer, args, tokenizer, train.global_batch_size, (rank, world, bf16))


def trained_and_reported(trainer, args, tokenizer, completions_per_step: int, group: tuple[int, int, bool]) -> None:
    """A TRL online trainer trained and timed per step under torchrun; rank 0 saves the adapter and prints the
    figures (completions/s per worker); the process group ends. `group`: (rank, world size, bf16)."""
    import torch.distributed as dist

    from benchmarks.trl_sft import saved_figures, train_timed

    (rank, world, bf16), timed = group, train_timed(trainer, args.warmup)
    if rank == 0:
        figures = saved_figures(timed, tokenizer, args.out, completions_per_step, "completions", world, bf16)
        print(json.dumps(figures), flush=True)
    dist.destroy_process_group()


def held_out(cfg, model: str, eval_file: str, adapter: str | None, rewards: list[str] | None = None) -> dict:
    """The mean of each reward function (the config's, or `rewards`) over the held-out prompts, answered greedily by
    `adapter` on `model` in plain PEFT."""
    from benchmarks.exact_match import held_out_rewards

    figures = held_out_rewards(model, adapter, eval_file, rewards or cfg.grpo.reward_funcs,
                               cfg.rollout.max_completion_tokens, cfg.data.max_eval_rows or 0)
    return {f"held_out_{k}": v for k, v in figures.items() if k != "adapter"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    from benchmarks.common import report_side_by_side, torchrun

    cfg = load_config(args.config, overrides(args))
    ensure_embedded(cfg)
    plan, sources = plan_files(cfg)
    cfg = plan.cfg
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"config": args.config, "overrides": overrides(args), "model": cfg.model.path,
              "steps": cfg.train.max_steps, "warmup": args.warmup, "workers": cfg.scaling.num_workers,
              "jobs": {f"max_staleness={k}" + (f", engine={e}" if args.engines else ""):
                       run_job(args, cfg, overrides(args) + staleness_overrides(k) + [f"rollout.engine={e}"])
                       for e in args.engines or [cfg.rollout.engine] for k in args.staleness or
                       [cfg.rollout.max_staleness]}}
    result["job"] = next(iter(result["jobs"].values()))
    flags = [f"--config={args.config}", *(f"--set={o}" for o in args.set), f"--warmup={args.warmup}",
             f"--model-path={cfg.model.path}", f"--train-file={sources.train[0].files[0]}",
             *([f"--steps={args.steps}"] if args.steps else []),
             *([f"--adapter={args.adapter}"] if args.adapter else [])]
    result["trl"] = torchrun(cfg.scaling.num_workers, "benchmarks.trl_grpo", *flags,
                             "--out", str(Path(args.out) / "trl"), "--trl-worker")
    eval_file = sources.eval.files[0]
    result["start"] = held_out(cfg, cfg.model.path, eval_file, args.adapter)
    for side in (*result["jobs"].values(), result["trl"]):
        side |= held_out(cfg, cfg.model.path, eval_file, side["adapter"])
        side["completions_per_second_over_trl"] = (side["completions_per_second_per_worker"]
                                                   / result["trl"]["completions_per_second_per_worker"])
    result["seconds"] = time.perf_counter() - T_START
    return report_side_by_side(result, "completions_per_second_per_worker", Path(args.out, "trl_grpo.json"))


if __name__ == "__main__":
    sys.exit(main())

"""On-policy distillation side by side: the job (`train.objective=distill`, the student's answers sampled in a Ray
actor, the teacher's adapter frozen beside the student's on the trainers' sharded base) against TRL's
DistillationTrainer with PEFT LoRA, its own generation (no vLLM) and the teacher as a second model (the base with
the teacher's adapter merged), both from one distill config.

    python -m benchmarks.trl_distill --config jobs/configs/smollm2_distill.yaml \\
        --set distill.teacher_adapter=models:/smollm2-grpo@champion --set mlflow.tracking_uri=...

Both sides take from the config (after any --set): the model, the teacher's adapter (a folder, a run or a registered
version, resolved once), the train and held-out prompts, LoRA, answer length, temperature, answers per optimizer
step and per forward, learning rate (constant), beta and steps; one answer per prompt (TRL samples one).
TRL runs under torchrun with gloo and FSDP2 via accelerate, on as many workers as the job. Figures per side:
completions per second per worker in the steady state (the first --warmup steps left out), peak memory per worker,
and the held-out accuracy of the saved adapter answering greedily in plain PEFT (--reward, the task's checker),
beside the instruct model's and the teacher's. Prints one JSON line and writes <out>/trl_distill.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from app.config.loading import load_config
from app.launch.inputs import plan_files
from benchmarks.trl_grpo import held_out, run_job, staleness_overrides, trained_and_reported

T_START = time.perf_counter()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trl_distill", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="jobs/configs/smollm2_distill.yaml", help="a distill config both sides follow")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the config's train.max_steps)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--reward", default="app.data.gym_tasks:score_answer", help="what scores a held-out answer")
    p.add_argument("--out", default="outputs/benchmark/distill")
    p.add_argument("--model-path", help=argparse.SUPPRESS)  # the torchrun side: the resolved model folder
    p.add_argument("--teacher", help=argparse.SUPPRESS)  # the torchrun side: the teacher adapter's folder
    p.add_argument("--train-file", help=argparse.SUPPRESS)  # the torchrun side: the resolved train prompts
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)  # the torchrun side
    return p.parse_args(argv)


def overrides(args) -> list[str]:
    return [*args.set, *([f"train.max_steps={args.steps}"] if args.steps else [])]


def teacher_folder(cfg) -> Path:
    """distill.teacher_adapter's folder, a registered version's included (downloaded once)."""
    from app.tracking.adapters import adapter_folder
    from app.tracking.mlflow_run import fluent_tracking_uri

    source = cfg.distill.teacher_adapter
    registry = fluent_tracking_uri(cfg.mlflow.tracking_uri) if source.startswith("models:/") else None
    with registry or contextlib.nullcontext():
        return adapter_folder(source, cfg.train.output_dir)


def trl_worker(args) -> None:
    """Under torchrun: DistillationTrainer over the config's LoRA, the teacher merged into its own copy of the base,
    timed per step; rank 0 saves the adapter."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    from benchmarks.trl_sft import fsdp_on_cpu, trainer_arguments, trl_worker_start

    cfg = load_config(args.config, overrides(args))
    train, rollout, lora = cfg.train, cfg.rollout, cfg.lora
    rank, world, bf16, tokenizer, model, layer_class = trl_worker_start(args.model_path)
    model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                             target_modules=lora.target_modules, task_type="CAUSAL_LM"))
    base = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32, attn_implementation="sdpa")
    teacher = PeftModel.from_pretrained(base, args.teacher).merge_and_unload()
    records = [{"prompt": json.loads(line)["prompt"]} for line in open(args.train_file) if line.strip()]
    shape = argparse.Namespace(out=args.out, steps=train.max_steps, micro_batch=train.micro_batch_size,
                               lr=train.learning_rate)
    config = DistillationConfig(**trainer_arguments(shape, layer_class, bf16),
                                gradient_accumulation_steps=train.global_batch_size // (world * train.micro_batch_size),
                                max_completion_length=rollout.max_completion_tokens, temperature=rollout.temperature,
                                top_p=1.0, beta=cfg.distill.beta)
    trainer = fsdp_on_cpu(DistillationTrainer)(model=model, teacher_model=teacher, args=config,
                                               train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    trained_and_reported(trainer, args, tokenizer, train.global_batch_size, (rank, world, bf16))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    from benchmarks.common import report_side_by_side, torchrun

    cfg = load_config(args.config, overrides(args))
    plan, sources = plan_files(cfg)
    cfg, teacher = plan.cfg, str(teacher_folder(plan.cfg))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"config": args.config, "overrides": overrides(args), "model": cfg.model.path, "teacher": teacher,
              "steps": cfg.train.max_steps, "warmup": args.warmup, "workers": cfg.scaling.num_workers,
              "job": run_job(args, cfg, overrides(args) + staleness_overrides(cfg.rollout.max_staleness),
                             "trl-distill-job")}
    flags = [f"--config={args.config}", *(f"--set={o}" for o in args.set), f"--warmup={args.warmup}",
             f"--model-path={cfg.model.path}", f"--teacher={teacher}", f"--train-file={sources.train[0].files[0]}",
             *([f"--steps={args.steps}"] if args.steps else [])]
    result["trl"] = torchrun(cfg.scaling.num_workers, "benchmarks.trl_distill", *flags,
                             "--out", str(Path(args.out) / "trl"), "--trl-worker")
    eval_file = sources.eval.files[0]
    result["start"] = held_out(cfg, cfg.model.path, eval_file, None, [args.reward])
    result["teacher_held_out"] = held_out(cfg, cfg.model.path, eval_file, teacher, [args.reward])
    for side in (result["job"], result["trl"]):
        side |= held_out(cfg, cfg.model.path, eval_file, side["adapter"], [args.reward])
        side["completions_per_second_over_trl"] = (side["completions_per_second_per_worker"]
                                                   / result["trl"]["completions_per_second_per_worker"])
    result["seconds"] = time.perf_counter() - T_START
    return report_side_by_side(result, "completions_per_second_per_worker", Path(args.out, "trl_distill.json"))


if __name__ == "__main__":
    sys.exit(main())

"""One GRPO step's rollouts, each way to sample side by side: answers/s with the policy's sync included.

    python -m benchmarks.rollouts [--config jobs/configs/smollm2_grpo.yaml] [--cores 1,2] [--steps 3] [--no-vllm]

The config's model, LoRA shape and rollout settings (answers per prompt, answer length, temperature, top-p/top-k), and
its first train_batch / num_generations prompts from its data (8 reasoning-gym problems x 8 answers for
smollm2_grpo.yaml). Each way runs in a process of its own, on 1 core and on all of them; each step is a sync of
fresh LoRA weights (as an optimizer step sends) then the step's answers:
- `ours lora`: this project's sampler with the adapter beside the base (rollout.policy=lora);
- `ours merged`: the same with the adapter merged into its copy of the base at each sync (rollout.policy=merged);
- `vllm lora` (where vLLM is installed): rollout.engine=vllm as the actors run it (app/train/vllm_sampler.py, its
  engine in the measuring process): at each sync the adapter checked, written as a PEFT folder and handed to vLLM
  as a new LoRARequest (counted);
- `vllm merged`: the same with the adapter merged into vLLM's own weights at each sync (app/train/vllm_merging.py,
  counted), vLLM started without LoRA.
Prints a JSON line per measurement (the median of --steps after a warm-up step), then one with them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WAYS = ("ours lora", "ours merged", "vllm lora", "vllm merged")


def step_prompts(cfg, tokenizer) -> list[list[int]]:
    from app.data.gym_tasks import parse_spec, task_entries, task_record

    spec = parse_spec(cfg.data.train_path, "data.train_path")
    count = cfg.train.global_batch_size // cfg.rollout.num_generations
    records = [task_record(entry, spec.name) for entry in task_entries(spec, "data.train_path")[:count]]
    return [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in records]


def fresh_weights(sampler, step: int) -> dict:
    """LoRA weights as an optimizer step sends them (random, B not zero)."""
    import torch

    generator = torch.Generator().manual_seed(step)
    return {name: torch.randn(p.shape, generator=generator) * (0.02 if "lora_B" in name else 0.1)
            for name, p in sampler.model.named_parameters() if name in sampler.names}


def synced_steps(sampler, trainer, cfg, prompts, steps: int) -> list[float]:
    """Answers/s of each step after a warm-up one: a sync of fresh weights (shaped as `trainer`'s), then the step."""
    from app.train.sampling import adapter_checksum

    rates = []
    for step in range(steps + 1):
        weights = fresh_weights(trainer, step)
        started = time.perf_counter()
        sampler.load_adapter(weights, step, adapter_checksum(weights))
        answers = sampler.sample(prompts, cfg.rollout, seed=step)
        rates.append(len(answers) / (time.perf_counter() - started))
    return rates[1:]


def ours(cfg, prompts, steps: int) -> list[float]:
    from app.train.sampling import build_sampler

    sampler = build_sampler(cfg)
    return synced_steps(sampler, sampler, cfg, prompts, steps)


def vllm(cfg, prompts, steps: int) -> list[float]:
    """rollout.engine=vllm as the actors run it (app/train/vllm_sampler.py, its engine in this process): each sync
    a new LoRA request (rollout.policy=lora) or merged into vLLM's weights (merged)."""
    from app.train.sampling import build_sampler
    from app.train.vllm_sampler import VllmSampler

    trainer = build_sampler(cfg.with_set({"rollout.engine": "transformers"}))
    return synced_steps(VllmSampler(cfg, own_process=True), trainer, cfg, prompts, steps)


def measure(way: str, config: str, cores: int, steps: int) -> None:
    """In this process (started by `main` with the cores set): one way's answers/s, printed as a JSON line."""
    import torch

    from app.config.loading import load_config
    from app.model.base import load_tokenizer

    torch.set_num_threads(cores)
    engine = "transformers" if way.startswith("ours") else "vllm"
    cfg = load_config(config, [f"rollout.engine={engine}", f"rollout.policy={way.split()[1]}"])
    prompts = step_prompts(cfg, load_tokenizer(cfg.model, cfg.data.chat_template))
    rates = (ours if engine == "transformers" else vllm)(cfg, prompts, steps)
    print(json.dumps({"way": way, "cores": cores, "answers": len(prompts) * cfg.rollout.num_generations,
                      "answers_per_second": round(statistics.median(rates), 2)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollouts", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="jobs/configs/smollm2_grpo.yaml")
    p.add_argument("--cores", default=f"1,{os.cpu_count()}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one measurement, in a process of its own
    args = p.parse_args(argv)
    cores = [int(n) for n in args.cores.split(",")]
    if args.way:
        measure(args.way, args.config, cores[0], args.steps)
        return 0
    results = []
    for n in cores:
        for way in WAYS[:2] if args.no_vllm else WAYS:
            env = {**os.environ, "OMP_NUM_THREADS": str(n)}  # vLLM too: its engine runs in that process
            run = subprocess.run([sys.executable, "-m", "benchmarks.rollouts", "--way", way, "--config", args.config,
                                  "--cores", str(n), "--steps", str(args.steps)], env=env, capture_output=True,
                                 text=True)
            lines = [line for line in run.stdout.splitlines() if line.startswith('{"way"')]
            results.append(json.loads(lines[-1]) if lines else {"way": way, "cores": n,
                                                               "error": run.stderr[-1500:]})
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"config": args.config, "steps": args.steps, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

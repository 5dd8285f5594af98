"""The memory planner (app/plan/memory.py) next to what a training step measures, for each memory option.

    python -m benchmarks.memory --model-config benchmarks/shapes/bench_125m.json

On a random-weight model of the given shape (2 gloo workers here).

Parameters and optimizer state are compared exactly (bytes of each rank's local shards); the peak is
the worker's peak private (anonymous) resident memory above what it held before loading (libraries
and memory-mapped weight files excluded),
against the plan's total of model state, working copies and activations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from app.config.loading import load_config
from app.plan.memory import plan_memory
from benchmarks.common import DEFAULT_OUT, SHAPES, random_checkpoint, step_flags, torchrun, write_and_log

OPTIONS = {  # name -> config overrides (and so benchmarks/step.py flags)
    "fsdp, 2 workers": [],
    "no activation checkpointing": ["model.gradient_checkpointing=false"],
    "checkpointing every 2nd layer": ["model.checkpoint_every_n_layers=2"],
    "no reshard after forward": ["fsdp.reshard_after_forward=false"],
    "cpu offload (GPU only)": ["fsdp.cpu_offload=true", "scaling.use_gpu=true"],
    "hsdp [2 replicas x 1]": ["scaling.mesh=[2,1]"],
    "1 worker": ["scaling.num_workers=1"],
    "nf4 base (QLoRA)": ["model.quantization=nf4"],
}


def memory(model_config: str, only: list[str] | None, out: Path, steps: int = 3, seq_len: int = 512) -> dict:
    model_dir = random_checkpoint(model_config, out)
    base = [f"model.path={model_dir}", "model.load=sharded", "fsdp.param_dtype=float32", f"data.max_seq_len={seq_len}",
            "model.gradient_checkpointing=true", "model.compile=false",  # each option as given, not auto
            "train.micro_batch_size=2", "train.global_batch_size=4", "scaling.num_workers=2"]
    rows = []
    for name, overrides in OPTIONS.items():
        if only and name not in only:
            continue
        if "scaling.use_gpu=true" in overrides and not torch.cuda.is_available():
            print(f"skipped: {name} (no GPU here: on a CPU everything is in host memory already)", flush=True)
            continue
        cfg = load_config(None, [*base, *overrides] + (["train.global_batch_size=2"] if "1 worker" in name else []))
        plan = plan_memory(cfg)
        state = plan.device | plan.host
        measured = torchrun(cfg.scaling.num_workers, "benchmarks.step", "--model-path", str(model_dir),
                            "--load", "sharded", "--steps", str(steps), "--warmup", "1", *step_flags(cfg))
        row = {"option": name,
               "params_predicted_mb": state["parameters (sharded, stored dtype)"] / 2**20,
               "params_measured_mb": measured["param_bytes_per_worker"] / 2**20,
               "optimizer_predicted_mb": state["AdamW state (sharded, 2 x fp32)"] / 2**20,
               "optimizer_measured_mb": measured["optimizer_bytes_per_worker"] / 2**20,
               "peak_predicted_gb": (plan.device_total + sum(plan.host.values())) / 2**30,
               "peak_measured_gb": max(measured["peak_anon_rss_loading_gb"], measured["peak_anon_rss_training_gb"])
               - measured["rss_before_load_gb"],
               "step_seconds": measured["step_seconds_mean_steady"],
               f"loss_after_{steps}_steps": measured["last_micro_batch_loss"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model_config": model_config, "rows": rows}
    write_and_log(result, out, "memory")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--model-config", default=str(SHAPES / "bench_125m.json"))
    parser.add_argument("--only", nargs="+", help="run only these options (names as printed)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per option (the first is warm-up)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    memory(args.model_config, args.only, Path(args.out), args.steps, args.seq_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks that print figures: throughput against the torchrun baseline, loading memory, the planner.

    python -m jobs.benchmark compare --config jobs/configs/embedded.yaml --steps 100
    python -m jobs.benchmark loading --model-config jobs/configs/shapes/bench_750m.json --workers 1 2
    python -m jobs.benchmark memory --model-config jobs/configs/shapes/bench_125m.json

compare runs side by side, on the same model, sequence length, global batch, worker count and steps:
(a) this project's job end to end (Ray Train, Ray Data, MLflow), (b) the seed blog's plain torchrun
script (jobs/bench_baseline.py), (c) the training step alone under torchrun on synthetic tokens
(jobs/bench_step.py). Throughput is steady-state (warm-up steps excluded) sequence-slot tokens per
second per worker: global batch x sequence length / workers / mean step time, the same definition for
all three whatever their padding. Figures go to <out>/benchmark.json, a plot to <out>/benchmark.png,
and both to MLflow (experiment "benchmarks").
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

from app.config import FinetuneConfig, load_config

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def last_json_line(command: list[str]) -> dict:
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{out.stderr[-3000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def step_flags(cfg: FinetuneConfig) -> list[str]:
    """bench_step.py flags that reproduce the config's step."""
    flags = ["--seq-len", str(cfg.data.max_seq_len), "--micro-batch", str(cfg.train.micro_batch_size),
             "--accum", str(cfg.grad_accum_steps), "--param-dtype", cfg.fsdp.param_dtype, "--dtype", cfg.model.dtype,
             "--lora-r", str(cfg.lora.r)]
    flags += [] if cfg.model.gradient_checkpointing else ["--no-activation-checkpointing"]
    flags += [] if cfg.fsdp.reshard_after_forward else ["--no-reshard-after-forward"]
    flags += ["--cpu-offload"] if cfg.fsdp.cpu_offload else []
    flags += ["--mesh", *map(str, cfg.scaling.mesh)] if cfg.scaling.mesh else []
    return flags


def compare(args: argparse.Namespace) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    overrides = [*args.overrides, f"train.max_steps={args.steps}", f"train.output_dir={args.out}/runs",
                 f"train.run_name=bench-{stamp}"]
    cfg = load_config(args.config, overrides)
    workers = cfg.scaling.num_workers
    job = last_json_line([sys.executable, "-m", "jobs.finetune", "--config", args.config,
                          *(arg for item in overrides for arg in ("--set", item))])
    baseline = last_json_line([*TORCHRUN, f"--nproc-per-node={workers}", "-m", "jobs.bench_baseline",
                               "--model-path", cfg.model.path, "--data", cfg.data.train_path,
                               "--seq-len", str(cfg.data.max_seq_len), "--micro-batch", str(cfg.train.micro_batch_size),
                               "--global-batch", str(cfg.train.global_batch_size), "--steps", str(args.steps),
                               "--lr", str(cfg.train.learning_rate), "--lora-r", str(cfg.lora.r),
                               *(["--activation-checkpointing"] if cfg.model.gradient_checkpointing else [])])
    step = last_json_line([*TORCHRUN, f"--nproc-per-node={workers}", "-m", "jobs.bench_step",
                           "--model-path", cfg.model.path, "--load", cfg.model.load, "--steps", str(args.steps),
                           *step_flags(cfg)])
    slots = cfg.train.global_batch_size * cfg.data.max_seq_len / workers
    modes = {"a_job": job, "b_torchrun_baseline": baseline, "c_step_only": step}
    for figures in modes.values():
        figures["tokens_per_second_per_worker"] = slots / figures["step_seconds_mean_steady"]
    result = {"config": args.config, "workers": workers, "steps": args.steps, "seq_len": cfg.data.max_seq_len,
              "global_batch": cfg.train.global_batch_size, **modes,
              "ratio_a_over_b": job["tokens_per_second_per_worker"] / baseline["tokens_per_second_per_worker"],
              "ratio_a_over_c": job["tokens_per_second_per_worker"] / step["tokens_per_second_per_worker"]}
    write_and_log(result, Path(args.out), plot_compare, cfg.mlflow.tracking_uri)
    return result


def plot_compare(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["a_job", "b_torchrun_baseline", "c_step_only"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(axes, ["tokens_per_second_per_worker", "time_to_first_step_seconds", "peak_memory_gb"],
                              ["tokens/s per worker (steady)", "time to first step (s)", "peak memory per worker (GiB)"]):
        ax.bar([m.split("_", 1)[0] for m in modes], [result[m].get(key) or 0 for m in modes], color=["C0", "C1", "C2"])
        ax.set_title(label)
    fig.suptitle(f"{result['config']}: {result['workers']} workers, seq {result['seq_len']}, "
                 f"global batch {result['global_batch']}, {result['steps']} steps  (a) job  (b) torchrun baseline  (c) step only")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def loading(args: argparse.Namespace) -> dict:
    """Peak host memory of a worker while loading, whole-model vs sharded loading, at each worker count."""
    model_dir = Path(args.out) / f"model-{Path(args.model_config).stem}"
    if not (model_dir / "config.json").exists():
        build_random_checkpoint(args.model_config, model_dir)
    rows = []
    for dtype, workers, load in itertools.product(args.dtypes, args.workers, ("full", "sharded")):
        r = last_json_line([*TORCHRUN, f"--nproc-per-node={workers}", "-m", "jobs.bench_step", "--model-path",
                            str(model_dir), "--load", load, "--steps", "0", "--dtype", dtype])
        rows.append({"dtype": dtype, "workers": workers, "load": load,
                     "anon_rss_before_load_gb": r["rss_before_load_gb"],
                     "peak_anon_rss_loading_gb": r["peak_anon_rss_loading_gb"],
                     "peak_rss_incl_mapped_files_gb": r["peak_rss_after_load_gb"],
                     "load_seconds": r["load_seconds"], "param_bytes_per_worker": r["param_bytes_per_worker"]})
        print(json.dumps(rows[-1]), flush=True)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    result = {"model_config": args.model_config, "checkpoint_gb": size / 2**30, "rows": rows}
    write_and_log(result, Path(args.out), None, None, name="loading")
    return result


def build_random_checkpoint(config_file: str, out: Path) -> None:
    """A model of the given shape with random weights, saved as safetensors in bf16 (no download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(Path(config_file).read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def write_and_log(result: dict, out: Path, plot, tracking_uri: str | None, name: str = "benchmark") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    if plot:
        plot(result, out / f"{name}.png")
    if tracking_uri:
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment("benchmarks")
        with mlflow.start_run(run_name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"):
            mlflow.log_params({k: v for k, v in result.items() if not isinstance(v, dict)})
            mlflow.log_metrics({f"{mode}.{k}": v for mode, figures in result.items() if isinstance(figures, dict)
                                for k, v in figures.items() if isinstance(v, (int, float)) and v is not None})
            mlflow.log_artifact(str(out / f"{name}.json"))
            if plot:
                mlflow.log_artifact(str(out / f"{name}.png"))
    print(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.benchmark", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("compare", help="(a) the job, (b) the torchrun baseline, (c) the step alone")
    c.add_argument("--config", default="jobs/configs/embedded.yaml")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--steps", type=int, default=100)
    ld = commands.add_parser("loading", help="peak host memory while loading, whole vs sharded")
    ld.add_argument("--model-config", default="jobs/configs/shapes/bench_750m.json")
    ld.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ld.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    help="model.dtype to load as (the checkpoint is bf16: float32 makes every loader convert)")
    mem = commands.add_parser("memory", help="the planner's prediction next to what a step measures")
    mem.add_argument("--model-config", default="jobs/configs/shapes/bench_125m.json")
    mem.add_argument("--only", nargs="+", help="run only these options (names as printed)")
    for p in (c, ld, mem):
        p.add_argument("--out", default="outputs/benchmark")
    args = parser.parse_args(argv)
    if args.command == "memory":
        from jobs.bench_memory import memory

        memory(args)
    else:
        {"compare": compare, "loading": loading}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

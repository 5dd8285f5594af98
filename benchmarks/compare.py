"""Throughput side by side: the job against the seed's torchrun loop and the bare training step.

    python -m benchmarks.compare --config jobs/configs/embedded.yaml --steps 100

Runs, on the same model, sequence length, global batch, worker count and steps:
(a) this project's job end to end (Ray Train, Ray Data, MLflow), (b) the seed blog's plain torchrun
script (benchmarks/baseline.py), (c) the training step alone under torchrun on synthetic tokens
(benchmarks/step.py). Throughput is steady-state (warm-up steps excluded) sequence-slot tokens per
second per worker: global batch x sequence length / workers / mean step time, the same definition for
all three whatever their padding. Figures go to <out>/benchmark.json, a plot to <out>/benchmark.png,
and both to the project's MLflow store (experiment "benchmarks").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from app.config.loading import load_config
from benchmarks.common import DEFAULT_OUT, last_json_line, step_flags, torchrun, write_and_log

MODES = {"a_job": "(a) job", "b_torchrun_baseline": "(b) torchrun baseline", "c_step_only": "(c) step only"}


def compare(config: str, overrides: list[str], steps: int, out: Path) -> dict:
    overrides = ["model.gradient_checkpointing=false", "model.compile=false",  # as given to all three; yours win
                 *overrides, f"train.max_steps={steps}", f"train.run_name=bench-{time.strftime('%Y%m%d-%H%M%S')}"]
    cfg = load_config(config, overrides)
    workers = cfg.scaling.num_workers
    job = last_json_line([sys.executable, "-m", "jobs.finetune", "--config", config,
                          *(arg for item in overrides for arg in ("--set", item))])
    baseline = torchrun(workers, "benchmarks.baseline", "--model-path", cfg.model.path, "--data", cfg.data.train_path,
                        "--seq-len", str(cfg.data.max_seq_len), "--micro-batch", str(cfg.train.micro_batch_size),
                        "--global-batch", str(cfg.train.global_batch_size), "--steps", str(steps),
                        "--lr", str(cfg.train.learning_rate), "--lora-r", str(cfg.lora.r),
                        *(["--activation-checkpointing"] if cfg.model.gradient_checkpointing else []))
    step = torchrun(workers, "benchmarks.step", "--model-path", cfg.model.path, "--load", cfg.model.load,
                    "--steps", str(steps), *step_flags(cfg))
    slots = cfg.train.global_batch_size * cfg.data.max_seq_len / workers
    modes = dict(zip(MODES, (job, baseline, step)))
    for figures in modes.values():
        figures["tokens_per_second_per_worker"] = slots / figures["step_seconds_mean_steady"]
    result = {"config": config, "workers": workers, "steps": steps, "seq_len": cfg.data.max_seq_len,
              "global_batch": cfg.train.global_batch_size, **modes,
              "ratio_a_over_b": job["tokens_per_second_per_worker"] / baseline["tokens_per_second_per_worker"],
              "ratio_a_over_c": job["tokens_per_second_per_worker"] / step["tokens_per_second_per_worker"]}
    write_and_log(result, out, "benchmark", plot_compare)
    return result


def plot_compare(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    panels = {"tokens_per_second_per_worker": "tokens/s per worker (steady)",
              "time_to_first_step_seconds": "time to first step (s)", "peak_memory_gb": "peak memory per worker (GiB)"}
    for ax, (key, label) in zip(axes, panels.items()):
        ax.bar([m.split("_", 1)[0] for m in MODES], [result[m].get(key) or 0 for m in MODES], color=["C0", "C1", "C2"])
        ax.set_title(label)
    fig.suptitle(f"{result['config']}: {result['workers']} workers, seq {result['seq_len']}, global batch "
                 f"{result['global_batch']}, {result['steps']} steps  " + "  ".join(MODES.values()))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="jobs/configs/embedded.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    compare(args.config, args.overrides, args.steps, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

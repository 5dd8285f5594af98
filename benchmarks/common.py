"""What the benchmark commands share: running torchrun scripts, random-weight checkpoints, and writing
figures (JSON, a plot, and a run in the project's own MLflow store, experiment "benchmarks")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import UserInputError
from app.plan.dtypes import DTYPE_KEYS
from app.plan.plan import PER_RECORD_MODES, Plan, autos_left

if TYPE_CHECKING:
    from app.config.schema import FinetuneConfig

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
SHAPES = Path(__file__).resolve().parent / "shapes"
# the job as its users run it: checkpointing, compile, micro-batch and mesh chosen by the plan (docs/performance.md)
AUTO_CHOICES = ["model.gradient_checkpointing=auto", "model.compile=auto", "train.micro_batch_size=auto",
                "scaling.mesh=auto"]
DEFAULT_OUT = "outputs/benchmark"


def last_json_line(command: list[str]) -> dict:
    """Run a command; its last stdout line starting with '{' is its result."""
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{out.stderr[-3000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def torchrun(workers: int, module: str, *args: str) -> dict:
    return last_json_line([*TORCHRUN, f"--nproc-per-node={workers}", "-m", module, *args])


def step_flags(cfg: FinetuneConfig) -> list[str]:
    """benchmarks/step.py flags that reproduce the config's training step (its dtypes may be auto: step.py
    decides them as the workers do)."""
    auto = [key for key in autos_left(cfg) if key not in {*DTYPE_KEYS, *PER_RECORD_MODES}]
    if auto:
        raise UserInputError(f"{auto[0]}=auto: benchmarks/step.py reproduces a decided step; give it a value "
                             "(`python -m jobs.plan` prints what the plan decides)")
    flags = ["--seq-len", str(cfg.data.max_seq_len), "--micro-batch", str(cfg.train.micro_batch_size),
             "--accum", str(Plan(cfg).grad_accum_steps), "--param-dtype", cfg.fsdp.param_dtype,
             "--dtype", cfg.model.dtype, "--lora-r", str(cfg.lora.r),
             "--loss-chunk-tokens", str(cfg.train.loss_chunk_tokens)]
    flags += ["--checkpoint-every-n-layers", str(cfg.model.checkpoint_every_n_layers)] \
        if cfg.model.gradient_checkpointing else ["--no-activation-checkpointing"]
    flags += [] if cfg.fsdp.reshard_after_forward else ["--no-reshard-after-forward"]
    flags += ["--cpu-offload"] if cfg.fsdp.cpu_offload else []
    flags += ["--compile"] if cfg.model.compile else []
    flags += ["--quantization", cfg.model.quantization] if cfg.model.quantization != "none" else []
    flags += ["--attn-implementation", cfg.model.attn_implementation] if cfg.model.attn_implementation else []
    flags += ["--mesh", *map(str, cfg.scaling.mesh_shape(cfg.scaling.num_workers))] if cfg.scaling.mesh else []
    return flags


def random_checkpoint(config_file: str, out: Path) -> Path:
    """A model of the given shape with random weights, saved as bf16 safetensors under `out` (built once)."""
    model_dir = out / f"model-{Path(config_file).stem}"
    if (model_dir / "config.json").exists():
        return model_dir
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(Path(config_file).read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    return model_dir


def write_and_log(result: dict, out: Path, name: str, plot=None) -> None:
    """`<out>/<name>.json` (+ `.png` from `plot(result, path)`), printed, and logged as one MLflow run."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"{name}.json"]
    files[0].write_text(json.dumps(result, indent=2))
    if plot:
        files.append(out / f"{name}.png")
        plot(result, files[1])
    log_to_mlflow(result, name, files)
    print(json.dumps(result, indent=2))


def log_to_mlflow(result: dict, name: str, files: list[Path]) -> None:
    """Into the project's own store: $MLFLOW_TRACKING_URI, else outputs/mlflow.db (artifacts beside it)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from app.config.loading import load_config
    from app.tracking.mlflow_run import get_or_create_experiment

    project = load_config(None)
    if project.output.is_local:
        Path(project.output.root).mkdir(parents=True, exist_ok=True)
    client = MlflowClient(project.mlflow.tracking_uri)
    run = client.create_run(get_or_create_experiment(client, "benchmarks"),
                            run_name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    now = int(time.time() * 1000)
    params = [Param(k, str(v)) for k, v in result.items() if not isinstance(v, (dict, list))]
    metrics = [Metric(f"{mode}.{k}", float(v), now, 0) for mode, figures in result.items()
               if isinstance(figures, dict) for k, v in figures.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    for file in files:
        client.log_artifact(run.info.run_id, str(file))
    client.set_terminated(run.info.run_id)
    print(f"MLflow: {project.mlflow.tracking_uri}, experiment benchmarks, run {run.info.run_name}", file=sys.stderr)


def report_side_by_side(result: dict, figure: str, out_file: Path) -> int:
    """The job's `figure` over TRL's as `<figure without _per_worker>_job_over_trl`, the whole result written to
    `out_file` and printed as one JSON line."""
    result[f"{figure.removesuffix('_per_worker')}_job_over_trl"] = result["job"][figure] / result["trl"][figure]
    out_file.write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0


def run_job_steadily(config: str, overrides: list[str], warmup: int) -> tuple[dict, object, list[int], float]:
    """`python -m jobs.finetune` of `config` with `overrides`, as a user runs it: (its summary, `curve(name)` ->
    {step: value} from its MLflow run, its steady steps (the first `warmup` left out), their seconds in all)."""
    from mlflow.tracking import MlflowClient

    summary = last_json_line([sys.executable, "-m", "jobs.finetune", "--config", config,
                              *(a for o in overrides for a in ("--set", o))])
    client = MlflowClient(summary["tracking_uri"])
    curve = lambda name: {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], name)}
    tokens, speed = curve("step_tokens"), curve("tokens_per_second")
    steady = sorted(tokens)[warmup:]
    return summary, curve, steady, sum(tokens[s] / speed[s] for s in steady)

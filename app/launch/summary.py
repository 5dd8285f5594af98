"""The job's one-line JSON summary (the last line of its output) and the tags that name its best evaluation.

Built from what the workers reported through Ray Train, not from MLflow: a tracking server that is down
at the end costs a warning, not the summary.
"""

from __future__ import annotations

import math

from app.config.schema import FinetuneConfig
from app.train.progress import StartupClock


def best_tags(cfg: FinetuneConfig, summary: dict) -> dict[str, str]:
    """Tags that name the run's best evaluation (and which weights its adapter holds)."""
    if summary.get("best_step") is None:
        return {}
    return {"best_metric": cfg.train.best_metric, "best_step": str(int(summary["best_step"])),
            "best_value": f"{summary['best_value']:.6g}", "adapter_weights": cfg.train.export,
            "stopped_early": str(bool(summary.get("stopped_early"))).lower()}


def startup_timeline(figures: dict, kind: str = "startup_seconds") -> dict[str, float]:
    """The driver's and the workers' start-up points (kind: seconds from the job's start, or rank 0's
    resident memory there), in the order they were reached."""
    order = {k.split("/", 1)[1]: v for k, v in figures.items() if k.startswith("startup_seconds/")}
    points = {k.split("/", 1)[1]: round(v, 2) for k, v in figures.items() if k.startswith(f"{kind}/") and v is not None}
    return dict(sorted(points.items(), key=lambda kv: order.get(kv[0]) or 0))


def job_summary(cfg: FinetuneConfig, run_id: str, metrics: dict, startup: StartupClock, mlflow_synced: bool,
                model: dict[str, str], wall_seconds: float) -> dict:
    """`metrics`: the final checkpoint's metrics from Ray Train's result; `model`: the logged model's URIs."""
    metrics = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
    return {
        "mlflow_run_id": run_id,
        "tracking_uri": cfg.mlflow.tracking_uri,
        "experiment": cfg.mlflow.experiment,
        "run_name": cfg.train.run_name,
        "adapter_path": cfg.run_dir.adapter,
        "steps": int(metrics["steps"]),
        "initial_eval_loss": metrics["initial_eval_loss"],
        "final_train_loss": metrics["final_train_loss"],
        "final_eval_loss": metrics["final_eval_loss"],
        **{k: v for k, v in metrics.items() if k.startswith("final_eval_") and k != "final_eval_loss"},
        **{k: v for k, v in metrics.items() if k.startswith("initial_eval_") and k != "initial_eval_loss"},
        "best": {"metric": cfg.train.best_metric, "step": metrics.get("best_step"), "value": metrics.get("best_value"),
                 "exported": cfg.train.export == "best"},
        "stopped_early": bool(metrics.get("stopped_early")),
        "workers": metrics.get("final_workers"),  # the group the figures below come from (an elastic run's last)
        "tokens_per_second": metrics["tokens_per_second_steady"],
        "time_to_first_step_seconds": metrics.get("time_to_first_step_seconds"),
        "startup_seconds": startup_timeline(startup.seconds | metrics),
        "startup_rss_gb": startup_timeline(metrics, "startup_rss_gb"),
        "startup_private_gb": startup_timeline(metrics, "startup_private_gb"),
        "data_wait_fraction": metrics["data_wait_fraction"],
        "step_seconds_mean_steady": metrics["step_seconds_mean_steady"],
        # grpo: every worker's completions (and generated tokens) per second, and the trainers' time spent waiting
        **{k: metrics[k] for k in ("completions_per_second", "generated_tokens_per_second", "trainer_idle_share")
           if k in metrics},
        "first_step_seconds": metrics.get("first_step_seconds"),  # the last attempt's, of which waiting for data:
        "first_step_data_wait_seconds": metrics.get("first_step_data_wait_seconds"),
        "peak_memory_gb": metrics["peak_memory_gb_max_over_workers"],
        "mlflow_synced": mlflow_synced,
        **{k: v for k, v in model.items() if not k.startswith(ADAPTER_RUN)},
        **({"adapters": adapter_summaries(cfg, metrics, model)} if cfg.adapters else {}),
        "wall_seconds": round(wall_seconds, 1),
    }


ADAPTER_RUN = "adapter_run/"  # record_outcome's key of an adapter's own MLflow run (several adapters)


def adapter_summaries(cfg: FinetuneConfig, metrics: dict, model: dict[str, str]) -> dict[str, dict]:
    """Each adapter's figures (several adapters in one job): where it is, its own MLflow run, how it ended."""
    return {adapter.name: {"adapter_path": f"{cfg.run_dir.adapter}/{adapter.name}",
                           "mlflow_run_id": model.get(f"{ADAPTER_RUN}{adapter.name}"),
                           **{key: metrics.get(f"{adapter.name}/{key}")
                              for key in ("final_train_loss", "final_eval_loss", "best_step", "best_value")},
                           "stopped": bool(metrics.get(f"{adapter.name}/stopped"))}
            for adapter in cfg.adapters}

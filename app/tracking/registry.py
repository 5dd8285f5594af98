"""A finished run's adapter as an MLflow Model, registered as a version of `mlflow.registered_model`.

The model is app/tracking/pyfunc.py (MLflow "model from code") with the adapter as its artifact and, in its
model config, the base it needs: a hub id with its pinned revision, or a local path with a digest of
its weight files' bytes (so a reloaded version can tell it got the same base). The version carries the
run id, the base model and the run's eval figures as tags.
"""

from __future__ import annotations

import warnings
from importlib.metadata import version
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from app.config.schema import FinetuneConfig
from app.runs.layout import ADAPTER
from app.tracking.mlflow_run import fluent_tracking_uri
from app.tracking.pyfunc import weights_digest  # the registered model's own check: one definition

SERVED_MODEL = Path(__file__).parent / "pyfunc.py"
REQUIREMENTS = ("mlflow", "torch", "transformers", "peft", "accelerate", "safetensors")


def base_model_record(cfg: FinetuneConfig) -> dict[str, str]:
    record = {"base_model": cfg.model.path}
    if Path(cfg.model.path).is_dir():
        record["base_model_sha256"] = weights_digest(Path(cfg.model.path))
    elif cfg.model.revision:
        record["base_model_revision"] = cfg.model.revision
    return record


def _pinned_requirements() -> list[str]:
    # a local version label (torch's "+cpu") names a build no package index serves: pin the release
    return [f"{name}=={version(name).split('+')[0]}" for name in REQUIREMENTS]


def log_adapter_model(cfg: FinetuneConfig, run_id: str, summary: dict, folder: str | None = None
                      ) -> dict[str, str] | None:
    """Log the adapter (the run's, or the local `folder`: one of several adapters of a job) as the run's MLflow
    Model "model" and register it when `mlflow.registered_model` is set. Returns {"model_uri", and
    "registered_model", "version" when registered}."""
    base = base_model_record(cfg)
    adapter, _download = (folder, None) if folder else cfg.run_dir.local_copy(ADAPTER)  # lives as long as this call
    with (fluent_tracking_uri(cfg.mlflow.tracking_uri), mlflow.start_run(run_id=run_id, log_system_metrics=False),
          warnings.catch_warnings()):
        # an input example would make MLflow load the base model here to try it: none is given
        warnings.filterwarnings("ignore", message=".*input example was not provided")
        info = mlflow.pyfunc.log_model(
            name="model", python_model=str(SERVED_MODEL), artifacts={"adapter": str(adapter)},
            model_config={**base, "max_new_tokens": cfg.eval.max_new_tokens},
            pip_requirements=_pinned_requirements(), registered_model_name=cfg.mlflow.registered_model,
            metadata=base)
    result = {"model_uri": info.model_uri}
    if cfg.mlflow.registered_model:
        client = MlflowClient(cfg.mlflow.tracking_uri)
        version = info.registered_model_version
        figures = {k: v for k, v in summary.items() if isinstance(v, float) and
                   (k.startswith("final_eval_") or k == "initial_eval_loss")}
        tags = {"run_id": run_id, **base, **{k: f"{v:.6g}" for k, v in figures.items()}}
        for key, value in tags.items():
            client.set_model_version_tag(cfg.mlflow.registered_model, str(version), key, value)
        result |= {"registered_model": cfg.mlflow.registered_model, "version": str(version)}
    return result

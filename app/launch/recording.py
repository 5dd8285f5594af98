"""What the driver records in MLflow: the run opened (a new one, or the resumed one reopened) with the job's
tags, the best evaluation's tags, the adapter as the run's MLflow Model, and the run's end."""

from __future__ import annotations

import getpass
import os

import ray
from mlflow.tracking import MlflowClient

from app.config.objectives import objective_of
from app.config.schema import FinetuneConfig
from app.data.passes import source_key, source_names
from app.environment import in_ray_job, ray_job_id
from app.errors import first_line, warn
from app.eval_tasks.gym_lm_eval import with_gym_tasks
from app.eval_tasks.harness import Evaluation, scores, task_metadata
from app.launch.eval_tasks import evaluate_where_it_fits
from app.launch.inputs import CheckedInputs
from app.launch.summary import ADAPTER_RUN, best_tags
from app.plan.plan import Plan
from app.tracking import mlflow_run
from app.tracking.adapter_runs import record_adapter_runs
from app.tracking.registry import log_adapter_model
from app.tracking.task_scores import Evaluated, record_scores


def run_tags(cfg: FinetuneConfig, inputs: CheckedInputs) -> dict[str, str | None]:
    return {
        "mlflow.user": getpass.getuser(),  # the UI's "Created by" and "Source"
        "mlflow.source.name": "jobs.finetune",
        "mlflow.source.type": "JOB" if in_ray_job() else "LOCAL",
        "base_model": cfg.model.path,
        "base_model_revision": cfg.model.revision,
        "mlflow.source.git.commit": os.environ.get("GIT_COMMIT") or mlflow_run.git_commit(),
        "ray.job_submission_id": ray_job_id(),
        "ray.job_id": ray.get_runtime_context().get_job_id() if ray.is_initialized() else None,
        "data.train_path": ", ".join(cfg.data.train_paths),
        "data.source_keys": source_keys_tag(cfg),
        "init_adapter": cfg.model.init_adapter,
        "init_adapter_sha256": inputs.init_adapter_sha256 or "none",  # what a resume must start from too
        "teacher_adapter": cfg.distill.teacher_adapter if inputs.teacher_sha256 else None,
        # the teacher a registry alias named when the run began ("none" for a distillation without a teacher adapter)
        "teacher_adapter_sha256": inputs.teacher_sha256 or ("none" if objective_of(cfg.train).taught else None),
    }


def source_keys_tag(cfg: FinetuneConfig) -> str | None:
    """Which metric key (data_share/<key>) is which source, where a name had to change to be one."""
    names = source_names(cfg.data.train_paths)
    if all(source_key(name) == name for name in names):
        return None
    return "; ".join(f"{source_key(name)}: {name}" for name in names)


def open_mlflow_run(plan: Plan, inputs: CheckedInputs, run_to_continue: str | None) -> str:
    """A new MLflow run (recorded in the run directory) with the plan's config as params and both configs as
    artifacts, or the resumed one reopened; the plan's reasons (what each decided value is and why) become
    `plan.<key>` tags (a resumed run's may differ: tags, not params)."""
    cfg = plan.cfg
    tags = run_tags(cfg, inputs) | {f"plan.{key}": why for key, why in plan.reasons.items()}
    if run_to_continue is not None:
        mlflow_run.reopen_run(cfg.mlflow.tracking_uri, run_to_continue, tags, cfg.model.revision)
        return run_to_continue
    run_id = mlflow_run.start_run(cfg, tags, {"data.train_rows": sum(inputs.train_rows),
                                              "data.eval_rows": inputs.eval_rows}, inputs.datasets(), plan.requested)
    cfg.run_dir.write_record(run_id, inputs.every_train_source()[1])
    return run_id


def record_outcome(cfg: FinetuneConfig, run_id: str, summary: dict) -> dict[str, str]:
    """A finished run's best evaluation as tags, and its adapter as the run's MLflow Model (and a registered
    version); returns the model's URIs. A failure warns: the adapter is on disk either way."""
    mlflow_run.set_tags(cfg.mlflow.tracking_uri, run_id, best_tags(cfg, summary))
    try:
        if cfg.adapters:  # several adapters: each its own run, nested under the job's
            return {f"{ADAPTER_RUN}{name}": child for name, child in record_adapter_runs(cfg, run_id, summary).items()}
        return log_adapter_model(cfg, run_id, summary) or {}
    except Exception as e:
        warn(f"MLflow: the adapter was not logged as a model ({type(e).__name__}: {first_line(e, 200)}); it is at "
             f"{cfg.run_dir.adapter}")
        return {}


def score_on_eval_tasks(cfg: FinetuneConfig, run_id: str, model: dict[str, str]) -> None:
    """train.eval_tasks on the finished run's adapter (where jobs.evaluate would run it), on the run and its
    registered version. A failure warns: the run has trained and its adapter is kept either way."""
    version = (model["registered_model"], model["version"]) if "version" in model else None
    try:
        results, where = evaluate_where_it_fits(
            cfg.model.path, cfg.run_dir.adapter, cfg.train.output_dir,
            with_gym_tasks(Evaluation(list(cfg.train.eval_tasks), seed=cfg.train.seed,
                                      metadata=task_metadata(cfg.model.path)), "train.eval_tasks"))
        figures = scores(results)
        evaluated = Evaluated(cfg.train.run_name, None, cfg.model.path, run_id, version)
        record_scores(MlflowClient(cfg.mlflow.tracking_uri), evaluated, figures, results)
    except Exception as e:
        warn(f"train.eval_tasks: not scored ({type(e).__name__}: {first_line(e, 200)}); "
             f"`python -m jobs.evaluate --adapter {cfg.train.run_name}` scores it later")
        return
    print(" | ".join(f"{key.removeprefix('lm_eval/')} {value:.4f}" for key, value in figures.items()
                     if not key.endswith("_stderr")) + f" (lm-eval, {where})", flush=True)


def end_run(cfg: FinetuneConfig, run_id: str, status: str) -> bool:
    """The run ended FINISHED, FAILED or KILLED; False when MLflow could not be told (the status is journaled)."""
    return mlflow_run.finish_run(cfg.mlflow.tracking_uri, run_id, status, cfg.run_dir)

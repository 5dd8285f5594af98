"""A Ray Tune sweep in MLflow (driver side, no Ray): its parent run, what becomes of a trial that a scheduler
stopped or a Ctrl-C cut short, and the comparison of every trial logged on the parent at the end.

Each trial's own run is a run of this product (app/launch/driver.py opens and ends it), nested under the
parent; what the trial cannot do itself, because Ray Tune ends its process from outside, is done here.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from mlflow.entities import Param, RunTag
from mlflow.tracking import MlflowClient

from app.config.schema import FinetuneConfig
from app.errors import first_line, warn
from app.tracking.logger import MAX_PARAM_CHARS, bound_http_calls
from app.tracking.mlflow_run import finish_run, get_or_create_experiment


def open_parent_run(cfg: FinetuneConfig, sweep: str) -> str:
    """The sweep's run: its space and scheduler as params, the trials nested under it."""
    bound_http_calls()
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment_id = get_or_create_experiment(client, cfg.mlflow.experiment)
    run = client.create_run(experiment_id, run_name=sweep, tags={"sweep": sweep, "sweep.role": "parent"})
    params = {f"tune.{k}": json.dumps(v) if isinstance(v, (dict, list)) else str(v)
              for k, v in cfg.tune.model_dump().items()} | {f"space.{k}": v for k, v in cfg.tune.space.items()}
    client.log_batch(run.info.run_id, params=[Param(key, value[:MAX_PARAM_CHARS]) for key, value in params.items()])
    return run.info.run_id


def reopen_parent_run(tracking_uri: str, run_id: str) -> None:
    """A resumed sweep's run: RUNNING again, its resumes counted."""
    client = MlflowClient(tracking_uri)
    resumes = int(client.get_run(run_id).data.tags.get("resumes", "0")) + 1
    client.update_run(run_id, status="RUNNING")
    client.set_tag(run_id, "resumes", str(resumes))


def trial_status(tracking_uri: str, run_id: str) -> str:
    """How a trial that did not train to its end stands: `stopped at N` (by the scheduler), `interrupted` (its run
    still RUNNING: the sweep was stopped), or the run's MLflow status (FAILED)."""
    try:
        run = MlflowClient(tracking_uri).get_run(run_id)
    except Exception as e:
        warn(f"MLflow: could not read run {run_id} ({first_line(e, 200)})")
        return "unknown"
    if "tune.stopped_at_step" in run.data.tags:
        return f"stopped at {run.data.tags['tune.stopped_at_step']}"
    return "interrupted" if run.info.status == "RUNNING" else run.info.status.lower()


def end_stopped_trial(cfg: FinetuneConfig, run_id: str, step: int, scheduler: str, adapter: Path | None) -> None:
    """A trial the scheduler stopped at `step`: KILLED (not FAILED), tagged with who stopped it and where, its
    adapter of that step (the checkpoint's, with train.checkpoint_adapter) published in the run directory and
    logged to the run, as a finished run's is."""
    tags = {"tune.stopped_by": scheduler, "tune.stopped_at_step": str(step)}
    try:
        client = MlflowClient(cfg.mlflow.tracking_uri)
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        if adapter is not None and adapter.is_dir():
            cfg.run_dir.publish_adapter(adapter)
            client.log_artifacts(run_id, str(adapter), "adapter")
    except Exception as e:
        warn(f"MLflow: trial run {run_id} stopped at step {step} was not tagged ({first_line(e, 200)})")
    finish_run(cfg.mlflow.tracking_uri, run_id, "KILLED", cfg.run_dir)


def end_interrupted_trials(cfg: FinetuneConfig, sweep: str) -> list[str]:
    """The trials' runs a stopped sweep (Ctrl-C, `ray job stop`) left RUNNING, reported or not, ended KILLED and
    tagged `tune.interrupted`; --resume continues them. Returns their names."""
    client = MlflowClient(cfg.mlflow.tracking_uri)
    try:
        experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
        running = client.search_runs([experiment.experiment_id], f"tags.sweep = '{sweep}' and attributes.status = "
                                     "'RUNNING' and tags.`mlflow.parentRunId` != ''") if experiment else []
    except Exception as e:
        warn(f"MLflow: the sweep's trial runs were not read ({first_line(e, 200)}); any left RUNNING stay so")
        return []
    for run in running:
        client.set_tag(run.info.run_id, "tune.interrupted", "true")
        finish_run(cfg.mlflow.tracking_uri, run.info.run_id, "KILLED", cfg.output.run(run.info.run_name))
    return [run.info.run_name for run in running]


def record_lineage(tracking_uri: str, run_id: str, origin: str, step: int, changes: str) -> None:
    """PBT copied another trial's checkpoint into this one: the event appended to the run's `pbt.lineage` tag
    (one line each: the step, the trial copied, what changed) and the latest in `pbt.exploited_from`/`_step`."""
    client = MlflowClient(tracking_uri)
    before = client.get_run(run_id).data.tags.get("pbt.lineage")
    event = f"step {step}: from {origin} ({changes or 'no change'})"
    client.log_batch(run_id, tags=[RunTag("pbt.lineage", "\n".join(filter(None, [before, event]))),
                                   RunTag("pbt.exploited_from", origin), RunTag("pbt.exploited_step", str(step))])


def log_comparison(tracking_uri: str, parent_id: str, trials: list[dict], metric: str, best: dict | None) -> None:
    """On the parent: the trials' table (params and figures, for MLflow's compare view), each trial's curve of
    `metric` in one plot, and the best trial's run and adapter as tags."""
    try:
        _log_comparison(MlflowClient(tracking_uri), parent_id, trials, metric, best)
    except Exception as e:  # the trials' own runs hold every figure; the comparison is a view of them
        warn(f"MLflow: the sweep's comparison was not logged ({first_line(e, 200)})")


def _log_comparison(client: MlflowClient, parent_id: str, trials: list[dict], metric: str, best: dict | None) -> None:
    columns = sorted({k for t in trials for k in t})
    client.log_table(parent_id, data={c: [t.get(c) for t in trials] for c in columns}, artifact_file="tune/trials.json")
    client.log_image(parent_id, curves_plot(client, trials, metric), artifact_file="tune/curves.png")
    if best is not None:
        client.log_batch(parent_id, tags=[RunTag("best_trial_run", best["run"]),
                                          RunTag("best_trial_run_id", best["run_id"]),
                                          RunTag("best_adapter", best["adapter"])])
        client.log_metric(parent_id, f"best_{metric}", best[metric])


def curves_plot(client: MlflowClient, trials: list[dict], metric: str):
    """Every trial's `metric` against its steps, one line each (matplotlib's Agg backend: no display needed)."""
    import matplotlib  # start-up: the sweep's end only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for trial in trials:
        history = sorted((m.step, m.value) for m in client.get_metric_history(trial["run_id"], metric)
                         if math.isfinite(m.value))
        if history:
            axes.plot(*zip(*history), marker="o", markersize=3, label=f"{trial['run']} ({trial['status']})")
    axes.set_xlabel("step")
    axes.set_ylabel(metric)
    axes.legend(fontsize=7)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    buffer.seek(0)
    return Image.open(buffer)

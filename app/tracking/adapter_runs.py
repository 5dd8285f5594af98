"""Each adapter of a job that trained several (`adapters:`) as its own MLflow run, nested under the job's run.

Recorded once the job has trained, from the job's run, where the workers logged each adapter's figures under its
name (`a/train_loss`): the adapter's run holds them under their own names, each value at its step and time; the
params of the config it would have been trained with alone; its best evaluation as tags; its exported folder as
the artifacts `adapter/` (what `PeftModel.from_pretrained` loads). The UI then compares the adapters as it
compares a sweep's runs. A resumed job finds the adapter runs it recorded before (tag `adapter`, FINISHED)
and records only the others; one whose recording was cut short is made again.
"""

from __future__ import annotations

from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from app.config.schema import FinetuneConfig
from app.runs.layout import ADAPTER
from app.tracking.mlflow_run import log_config
from app.tracking.registry import log_adapter_model

BATCH = 1000  # MLflow's most metrics per log_batch call (100 params)


def record_adapter_runs(cfg: FinetuneConfig, run_id: str, summary: dict) -> dict[str, str]:
    """Each adapter's run under the job's run `run_id`: {adapter name: its run id}."""
    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = client.get_run(run_id)
    recorded = {}
    for run in client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{run_id}' and tags.adapter != ''"):
        if run.info.status == "FINISHED":
            recorded[run.data.tags["adapter"]] = run.info.run_id
        else:  # an earlier recording cut short: made again whole
            client.delete_run(run.info.run_id)
    adapter_folder, _download = cfg.run_dir.local_copy(ADAPTER)  # the download lives as long as this call
    for adapter in cfg.adapters:
        if adapter.name in recorded:
            continue
        prefix = f"{adapter.name}/"
        tags = {"mlflow.parentRunId": run_id, "adapter": adapter.name, "best_metric": cfg.train.best_metric}
        if summary.get(f"{prefix}best_step") is not None:
            tags |= {"best_step": str(int(summary[f"{prefix}best_step"])),
                     "best_value": f"{summary[f'{prefix}best_value']:.6g}",
                     "stopped": str(bool(summary.get(f"{prefix}stopped"))).lower()}
        child = client.create_run(parent.info.experiment_id, run_name=f"{cfg.train.run_name}/{adapter.name}",
                                  tags=tags).info.run_id
        metrics = [Metric(key.removeprefix(prefix), point.value, point.timestamp, point.step)
                   for key in parent.data.metrics if key.startswith(prefix)
                   for point in client.get_metric_history(run_id, key)]
        for i in range(0, len(metrics), BATCH):
            client.log_batch(child, metrics=metrics[i:i + BATCH])
        alone = cfg.adapter_alone(adapter)
        log_config(client, child, alone, {})
        folder = str(Path(adapter_folder) / adapter.name)
        client.log_artifacts(child, folder, "adapter")
        if cfg.mlflow.registered_model:  # each adapter a version, tagged with its name
            figures = {key.removeprefix(prefix): value for key, value in summary.items()
                       if key.startswith(f"{prefix}final_eval_") and isinstance(value, float)}
            model = log_adapter_model(alone, child, figures, folder)
            client.set_model_version_tag(model["registered_model"], model["version"], "adapter", adapter.name)
        client.set_terminated(child, "FINISHED")
        recorded[adapter.name] = child
    return recorded

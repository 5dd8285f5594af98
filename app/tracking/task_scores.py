"""Where a standard evaluation's scores go, and the registry's aliases (jobs.evaluate, jobs.promote).

An adapter is named as everywhere (app/tracking/adapters.py), or as `models:/NAME@ALIAS`. Its scores go into
the MLflow run that trained it (a run directory's record, or a registered version's run), else into a new run
of the `evaluations` experiment linked to the version; a registered version also carries them as tags.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from app.runs.layout import ADAPTER, OutputDir
from app.tracking.adapters import adapter_folder, base_of, registered_version
from app.tracking.mlflow_run import get_or_create_experiment

EVALUATIONS_EXPERIMENT = "evaluations"


@dataclass(frozen=True)
class Evaluated:
    """What an evaluation scored: the adapter's folder (None: the base alone), its base, the run that trained
    it and its registered version, where known."""

    source: str
    folder: Path | None
    base: str
    run_id: str | None = None
    version: tuple[str, str] | None = None  # (registered model, version)


def resolve(client: MlflowClient, source: str | None, output_dir: str, base: str | None = None) -> Evaluated:
    """The adapter `source` names (None: `base` alone), where it lies and where its scores belong."""
    if source is None:
        return Evaluated("base", None, base)
    if source.startswith("models:/"):
        name, version = registered_version(client, source)
        uri = f"models:/{name}/{version}"
        folder = adapter_folder(uri)
        return Evaluated(source, folder, base or base_of(folder, uri).path,
                         client.get_model_version(name, version).run_id, (name, version))
    folder = adapter_folder(source, output_dir)
    run = OutputDir(str(folder.resolve().parent.parent)).run(folder.parent.name)  # output_dir may be relative
    run_id = run.recorded_mlflow_run_id() if folder.name == ADAPTER and run.has_record() else None
    return Evaluated(source, folder, base or base_of(folder).path, run_id)


def record_scores(client: MlflowClient, evaluated: Evaluated, figures: dict[str, float], results: dict) -> str:
    """Log the scores (and lm-eval's results as `lm_eval/results.json`) on the adapter's run, or on a new run of
    the evaluations experiment; tag a registered version with them. The run's id."""
    run_id = evaluated.run_id
    if run_id is None:
        tags = {"evaluated": evaluated.source, "base_model": evaluated.base}
        if evaluated.version:
            tags |= {"registered_model": evaluated.version[0], "model_version": evaluated.version[1]}
        run = client.create_run(get_or_create_experiment(client, EVALUATIONS_EXPERIMENT), tags=tags,
                                run_name=f"lm-eval-{evaluated.source.rsplit('/', 1)[-1]}")
        run_id = run.info.run_id
        client.set_terminated(run_id)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(key, value, now, 0) for key, value in figures.items()])
    client.log_text(run_id, json.dumps(results, indent=1, default=str), "lm_eval/results.json")
    if evaluated.version:
        for key, value in figures.items():
            if not key.endswith("_stderr"):
                client.set_model_version_tag(*evaluated.version, key, f"{value:.6g}")
    return run_id

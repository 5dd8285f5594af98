"""MLflow: the run's lifecycle (driver) and metric and artifact logging (rank 0 of the workers).

One run per job: the driver creates it and passes its id to the workers, so a restarted worker
continues the same run. Rank 0 logs through app/tracking/logger.py; what the server does not take is kept
in the run directory's journal and sent later by `python -m jobs.sync` (app/tracking/journal.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import warnings
from pathlib import Path

import mlflow
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from app.config.schema import FinetuneConfig
from app.data.gym_tasks import is_task_source
from app.data.sources import DataSource
from app.errors import UserInputError, first_line, warn
from app.runs.layout import RunDir
from app.tracking.journal import Journal
from app.tracking.logger import MAX_PARAM_CHARS, bound_http_calls


@contextlib.contextmanager
def fluent_tracking_uri(uri: str):
    """MLflow's fluent API (log_model, models:/ downloads) on `uri` for the block only. mlflow.set_tracking_uri
    also exports $MLFLOW_TRACKING_URI, which every later config of this process (a second job run from a
    notebook, the next test) would read as its own tracking URI: the previous value is put back."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None: unset


def git_commit(cwd: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def get_or_create_experiment(client: MlflowClient, name: str) -> str:
    """The experiment's id; a new experiment in a local (sqlite) store keeps its artifacts beside the
    database file, not in MLflow's default `./mlruns` of whatever directory the process runs in."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifacts = None
    if client.tracking_uri.startswith("sqlite:///"):
        artifacts = (Path(client.tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=artifacts)


def start_run(cfg: FinetuneConfig, tags: dict[str, str | None], extra_params: dict[str, object],
              datasets: list[tuple[str, DataSource, str]] = (), requested: FinetuneConfig | None = None) -> str:
    """Create the job's run with the resolved config as params and as an artifact (beside it the config as
    `requested`, `auto` and all, where given), and the data as dataset inputs ((context, source, digest) each);
    a sweep's run is tagged with the sweep and nested under its parent run."""
    bound_http_calls()
    if cfg.output.is_local:
        Path(cfg.output.root).mkdir(parents=True, exist_ok=True)  # the local MLflow store lives there
    client = MlflowClient(cfg.mlflow.tracking_uri)
    tags = tags | {"sweep": cfg.mlflow.sweep, "mlflow.parentRunId": cfg.mlflow.parent_run_id}
    run = client.create_run(get_or_create_experiment(client, cfg.mlflow.experiment),
                            run_name=cfg.train.run_name,
                            tags={k: v for k, v in tags.items() if v is not None})
    log_config(client, run.info.run_id, cfg, extra_params)
    if requested is not None:
        client.log_text(run.info.run_id, requested.to_yaml(), "config/requested.yaml")
    inputs = [dataset_input(source, context, digest) for context, source, digest in datasets]
    if inputs:
        client.log_inputs(run.info.run_id, datasets=inputs)
    return run.info.run_id


def log_config(client: MlflowClient, run_id: str, cfg: FinetuneConfig, extra_params: dict[str, object]) -> None:
    """The config as the run's params (with `extra_params`; 100 a call, MLflow's most) and as config/resolved.yaml."""
    params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in {**cfg.flat(), **extra_params}.items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i:i + 100])
    client.log_text(run_id, cfg.to_yaml(), "config/resolved.yaml")


def dataset_input(source: DataSource, context: str, digest: str) -> DatasetInput:
    """The data as an MLflow dataset input: where it lives, and its digest (app.data.sources.source_digest),
    so the UI shows which runs trained on the same data."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    if source.kind == "hf_hub":
        origin = HuggingFaceDatasetSource(path=source.location)
    else:
        where = source.files[0] if is_task_source(source.location) else source.location  # a task: its generated file
        with warnings.catch_warnings():  # MLflow registers its local-file source twice ("" and "file")
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            origin = resolve_dataset_source(where if "://" in where else Path(where).resolve().as_uri())
    name = source.location if is_task_source(source.location) else Path(source.location.rstrip("/")).name
    dataset = MetaDataset(origin, name=name, digest=digest)
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])


def finish_run(tracking_uri: str, run_id: str, status: str, run_dir: RunDir, attempts: int = 3) -> bool:
    """End the run as FINISHED, FAILED or KILLED, a few tries with bounded timeouts (the server may be
    restarting). If it cannot be reached, the status goes to the run's journal for `python -m jobs.sync`
    and the job still ends as it should: training is done and the adapter is on disk."""
    bound_http_calls()
    for attempt in range(attempts):
        try:
            MlflowClient(tracking_uri).set_terminated(run_id, status=status)
            return True
        except Exception as e:
            warn(f"MLflow: could not end run {run_id} as {status} ({first_line(e, 200)})")
            if attempt < attempts - 1:
                time.sleep(2.0 * (attempt + 1))
    journal = Journal(run_dir)
    journal.add_status(status)
    warn(f"MLflow unreachable: run {run_id} stays open there until `python -m jobs.sync {run_dir.name}` sends "
         f"what {journal.location} keeps")
    return False


def set_tags(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Tags the driver knows after training (the best evaluation); a failure only warns."""
    if not tags:
        return
    try:
        MlflowClient(tracking_uri).log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    except Exception as e:
        warn(f"MLflow: could not tag {', '.join(tags)} ({first_line(e, 200)})")


def log_driver_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float]) -> None:
    """Figures the driver knows before training (data counts), at step 0; a failure only warns."""
    now = int(time.time() * 1000)
    try:
        MlflowClient(tracking_uri).log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    except Exception as e:
        warn(f"MLflow: could not log {', '.join(metrics)} ({first_line(e, 200)})")


def reopen_run(tracking_uri: str, run_id: str, job_tags: dict[str, str | None], revision: str | None) -> None:
    """A resumed job continues its run: back to RUNNING, the resume counted in a tag, and the run's job
    tags naming this job now (what `jobs.submit list` reconciles the run with). It must train the base
    model the run started with (the same hub commit), from the same starting adapter (the same bytes)."""
    bound_http_calls()
    client = MlflowClient(tracking_uri)
    tags = client.get_run(run_id).data.tags
    started_with = tags.get("base_model_revision")
    if started_with and revision and started_with != revision:
        raise UserInputError(f"--resume: the run trained {tags.get('base_model')} at revision {started_with}, and "
                             f"model.revision now resolves to {revision}; set model.revision={started_with}")
    check_same_init_adapter(tags, job_tags.get("init_adapter"), job_tags.get("init_adapter_sha256"))
    check_same_teacher(tags, job_tags.get("teacher_adapter"), job_tags.get("teacher_adapter_sha256"))
    resumes = int(tags.get("resumes", "0")) + 1
    client.update_run(run_id, status="RUNNING")
    tags = {"resumes": str(resumes)} | {k: v for k, v in job_tags.items() if k.startswith("ray.") and v}
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def check_same_init_adapter(run_tags: dict[str, str], source: str | None, sha256: str | None) -> None:
    """A resumed run starts from the adapter its first attempt did (with DPO and GRPO: its reference): the same
    weights, whatever model.init_adapter names now (a models:/NAME@alias that moved, a folder written over)."""
    started = run_tags.get("init_adapter_sha256")  # "none": from a fresh adapter; absent: an older version's run
    if started is None or started == (sha256 or "none"):
        return
    was = f"{run_tags.get('init_adapter')} (sha256 {started[:12]})" if started != "none" else "a fresh adapter"
    now = (f"model.init_adapter={source} gives sha256 {sha256[:12]}" if sha256 and sha256 != "none"
           else "model.init_adapter is not set")
    raise UserInputError(f"--resume: the run started from {was}, and {now}: it would train (and measure against) "
                         "another adapter; point model.init_adapter at the one it started from")


def check_same_teacher(run_tags: dict[str, str], source: str | None, sha256: str | None) -> None:
    """A resumed distillation learns from the teacher its first attempt did, whatever distill.teacher_adapter
    names now (an alias moved to a newer champion, a folder written over)."""
    started = run_tags.get("teacher_adapter_sha256")
    if started is None or started == (sha256 or "none"):
        return
    raise UserInputError(f"--resume: the run learned from {run_tags.get('teacher_adapter') or 'no teacher adapter'} "
                         f"(sha256 {started[:12]}), "
                         f"and distill.teacher_adapter={source} gives {(sha256 or 'no adapter')[:12]}: it would "
                         "learn from another teacher; point distill.teacher_adapter at the one it started with "
                         "(models:/NAME/VERSION)")


JOB_TO_RUN_STATUS = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "STOPPED": "KILLED"}


def reconcile_runs(tracking_uri: str, ended_jobs: dict[str, str]) -> list[str]:
    """End the MLflow runs still RUNNING whose Ray job (tag ray.job_submission_id) has ended; one line
    per run changed. An unreachable server changes nothing."""
    bound_http_calls()
    client = MlflowClient(tracking_uri)
    try:
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, "attributes.status = 'RUNNING'") if experiments else []
    except Exception as e:
        warn(f"MLflow: runs not reconciled with their jobs ({first_line(e, 200)})")
        return []
    changed = []
    for run in runs:
        job = run.data.tags.get("ray.job_submission_id")
        if job in ended_jobs:
            status = JOB_TO_RUN_STATUS[ended_jobs[job]]
            client.set_terminated(run.info.run_id, status=status)
            changed.append(f"MLflow run {run.info.run_name}: RUNNING -> {status} (its job {job} is {ended_jobs[job]})")
    return changed

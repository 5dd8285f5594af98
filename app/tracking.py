"""MLflow: the run's lifecycle (driver) and metric and artifact logging (rank 0 of the workers).

One run per job: the driver creates it and passes its id to the workers, so a restarted worker
continues the same run. Metrics go through a background thread in batches: a slow or unreachable
tracking server delays nothing on the training step and never kills training. Metrics it could not
send by the end are written beside the run's checkpoints, and the outage is reported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import DatasetInput, InputTag, Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from app.config import FinetuneConfig
from app.datasource import DataSource
from app.layout import OutputDir

log = logging.getLogger(__name__)
MAX_PARAM_CHARS = 6000


def git_commit(cwd: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def get_or_create_experiment(client: MlflowClient, name: str, output: OutputDir) -> str:
    """The experiment's id; a new experiment in a local (sqlite) store keeps its artifacts beside the store,
    not in MLflow's default `./mlruns` of whatever directory the process runs in."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    local = client.tracking_uri.startswith("sqlite:")
    return client.create_experiment(name, artifact_location=output.mlflow_artifacts.as_uri() if local else None)


def start_run(cfg: FinetuneConfig, tags: dict[str, str | None], extra_params: dict[str, object],
              datasets: list[tuple[str, DataSource | None]] = ()) -> str:
    """Create the job's run with the resolved config as params and as an artifact, and the data as
    dataset inputs; a sweep's run is tagged with the sweep and nested under its parent run."""
    cfg.output.root.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    tags = tags | {"sweep": cfg.mlflow.sweep, "mlflow.parentRunId": cfg.mlflow.parent_run_id}
    run = client.create_run(get_or_create_experiment(client, cfg.mlflow.experiment, cfg.output),
                            run_name=cfg.train.run_name,
                            tags={k: v for k, v in tags.items() if v is not None})
    params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in {**cfg.flat(), **extra_params}.items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    client.log_text(run.info.run_id, cfg.to_yaml(), "config/resolved.yaml")
    inputs = [dataset_input(source, context) for context, source in datasets if source is not None]
    if inputs:
        client.log_inputs(run.info.run_id, datasets=inputs)
    return run.info.run_id


def dataset_input(source: DataSource, context: str) -> DatasetInput:
    """The data as an MLflow dataset input: where it lives, and a digest of the bytes of its local
    files (of its location, for remote data), so the UI shows which runs trained on the same data."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    digest = hashlib.sha256(b"" if source.files else source.location.encode())
    for file in source.files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    if source.kind == "hf_hub":
        origin = HuggingFaceDatasetSource(path=source.location)
    else:
        with warnings.catch_warnings():  # MLflow registers its local-file source twice ("" and "file")
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            origin = resolve_dataset_source(source.location if "://" in source.location
                                            else Path(source.location).resolve().as_uri())
    dataset = MetaDataset(origin, name=Path(source.location.rstrip("/")).name, digest=digest.hexdigest()[:16])
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])


def finish_run(tracking_uri: str, run_id: str, status: str, attempts: int = 5) -> None:
    """status: FINISHED, FAILED or KILLED. Retried a few times: the server may be restarting."""
    for attempt in range(attempts):
        try:
            return MlflowClient(tracking_uri).set_terminated(run_id, status=status)
        except Exception as e:
            if attempt == attempts - 1:
                raise
            log.warning("MLflow: could not end run %s as %s (%s); retrying", run_id, status, str(e)[:200])
            time.sleep(2.0 * (attempt + 1))


def log_driver_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float]) -> None:
    """Figures the driver knows before training (data counts), at step 0; a failure only warns."""
    now = int(time.time() * 1000)
    try:
        MlflowClient(tracking_uri).log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    except Exception as e:
        log.warning("MLflow: could not log %s (%s)", ", ".join(metrics), str(e).splitlines()[0][:200])


def reopen_run(tracking_uri: str, run_id: str) -> None:
    """A resumed job continues its run: back to RUNNING, the resume counted in a tag."""
    client = MlflowClient(tracking_uri)
    resumes = int(client.get_run(run_id).data.tags.get("resumes", "0")) + 1
    client.update_run(run_id, status="RUNNING")
    client.set_tag(run_id, "resumes", str(resumes))


@dataclass
class _Batch:
    metrics: list[Metric] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)


class RunLogger:
    """Rank 0's handle on the run: metrics (and params) are queued and sent in batches by a background thread.

    While the server is unreachable the thread retries the oldest batch every `retry_seconds`; the
    training loop only ever appends to the queue. `close` waits a bounded time, then writes what is
    still unsent to `unsent_file` (JSON lines) and tags the run with the outage once it can.
    """

    def __init__(self, tracking_uri: str, run_id: str, unsent_file: Path | None = None,
                 retry_seconds: float = 2.0):
        self.client, self.run_id, self.retry_seconds = MlflowClient(tracking_uri), run_id, retry_seconds
        self.unsent_file = unsent_file
        self.failures = 0
        self.logged_through = self._last_logged_step()
        self._queue: queue.Queue[_Batch | None] = queue.Queue()
        self._pending: _Batch | None = None  # the batch being sent
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._send_forever, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def _last_logged_step(self) -> int:
        """-1 for a new run; after a restart, the last step an earlier attempt logged (-1 as well if
        the server cannot say: a few steps may then be logged twice, nothing is lost)."""
        try:
            steps = [m.step for key in ("train_loss", "eval_loss")
                     for m in self.client.get_metric_history(self.run_id, key)]
        except Exception as e:
            self._report_failure(e)
            return -1
        return max(steps, default=-1)

    def _report_failure(self, error: Exception) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 30 == 0:
            log.warning("MLflow unreachable (%d failed calls so far); metrics are kept and retried: %s",
                        self.failures, str(error).splitlines()[0][:200])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._queue.put(_Batch(metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]))

    def log_params(self, params: dict[str, object]) -> None:
        self._queue.put(_Batch(params=[Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]))

    def _send_forever(self) -> None:
        while (batch := self._queue.get()) is not None:
            self._pending = batch
            while True:
                try:
                    self.client.log_batch(self.run_id, metrics=batch.metrics, params=batch.params)
                    self._pending = None
                    break
                except MlflowException as e:
                    if e.error_code == "INVALID_PARAMETER_VALUE":  # rejected, not unreachable: retrying cannot help
                        log.warning("MLflow rejected a batch (%s); it is dropped", str(e).splitlines()[0][:200])
                        self._pending = None
                        break
                    self._report_failure(e)
                except Exception as e:  # the server being down must not end training
                    self._report_failure(e)
                if self._stopping.wait(self.retry_seconds):
                    return

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        self._with_retries(lambda: self.client.log_artifacts(self.run_id, str(local_dir), artifact_path),
                           f"artifacts {local_dir}")

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        self._with_retries(lambda: self.client.log_table(self.run_id, data=data, artifact_file=artifact_file),
                           f"table {artifact_file}")

    def _with_retries(self, call, what: str, attempts: int = 5) -> None:
        """End-of-run uploads: a few tries, then a warning; the files stay on disk either way."""
        for attempt in range(attempts):
            try:
                return call()
            except Exception as e:
                self._report_failure(e)
                time.sleep(self.retry_seconds * (attempt + 1))
        log.warning("MLflow: could not log %s after %d tries; it stays on local disk", what, attempts)

    def close(self, timeout: float = 60.0) -> None:
        """Send what is queued, waiting at most `timeout` seconds; keep what could not be sent."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._stopping.set()
        self._thread.join(self.retry_seconds)
        unsent = ([self._pending] if self._pending else []) + [b for b in _drain(self._queue) if b]
        if unsent and self.unsent_file is not None:
            self.unsent_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.unsent_file, "a") as f:
                for batch in unsent:
                    for m in batch.metrics:
                        row = {"key": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp}
                        f.write(json.dumps(row) + "\n")
                    for p in batch.params:
                        f.write(json.dumps({"param": p.key, "value": p.value}) + "\n")
            log.warning("MLflow: %d metric batches could not be sent; written to %s", len(unsent), self.unsent_file)
        if self.failures:
            log.warning("MLflow was unreachable for %d calls during this run", self.failures)
            try:
                self.client.set_tag(self.run_id, "mlflow_failed_calls", str(self.failures))
            except Exception:
                pass  # already reported in the log


def _drain(q: queue.Queue):
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


def final_metrics(tracking_uri: str, run_id: str) -> dict[str, float]:
    """The latest value of every metric of the run."""
    return dict(MlflowClient(tracking_uri).get_run(run_id).data.metrics)

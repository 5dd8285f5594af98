"""MLflow: the run's lifecycle (driver) and metric and artifact logging (rank 0 of the workers).

One run per job: the driver creates it and passes its id to the workers, so a restarted worker
continues the same run. Metrics go through a background thread in batches: a slow or unreachable
tracking server delays nothing on the training step and never kills training.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from app.config import FinetuneConfig

log = logging.getLogger(__name__)
MAX_PARAM_CHARS = 6000


def git_commit(cwd: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def get_or_create_experiment(client: MlflowClient, cfg: FinetuneConfig) -> str:
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    if experiment is not None:
        return experiment.experiment_id
    artifacts = None
    if cfg.mlflow.tracking_uri.startswith("sqlite:"):  # a local store keeps artifacts beside it
        artifacts = (Path(cfg.train.output_dir) / "mlartifacts").as_uri()
    return client.create_experiment(cfg.mlflow.experiment, artifact_location=artifacts)


def start_run(cfg: FinetuneConfig, tags: dict[str, str], extra_params: dict[str, object]) -> str:
    """Create the job's run with the resolved config as params and as an artifact; returns its id."""
    Path(cfg.train.output_dir).mkdir(parents=True, exist_ok=True)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = client.create_run(get_or_create_experiment(client, cfg), run_name=cfg.train.run_name,
                            tags={k: v for k, v in tags.items() if v is not None})
    params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in {**cfg.flat(), **extra_params}.items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    client.log_text(run.info.run_id, cfg.to_yaml(), "config/resolved.yaml")
    return run.info.run_id


def finish_run(tracking_uri: str, run_id: str, status: str) -> None:
    """status: FINISHED, FAILED or KILLED."""
    MlflowClient(tracking_uri).set_terminated(run_id, status=status)


def reopen_run(tracking_uri: str, run_id: str) -> None:
    """A resumed job continues its run: back to RUNNING, the resume counted in a tag."""
    client = MlflowClient(tracking_uri)
    resumes = int(client.get_run(run_id).data.tags.get("resumes", "0")) + 1
    client.update_run(run_id, status="RUNNING")
    client.set_tag(run_id, "resumes", str(resumes))


class RunLogger:
    """Rank 0's handle on the run: metrics are queued and sent in batches by a background thread."""

    def __init__(self, tracking_uri: str, run_id: str, retry_seconds: float = 2.0):
        self.client, self.run_id, self.retry_seconds = MlflowClient(tracking_uri), run_id, retry_seconds
        self.logged_through = self._last_logged_step()
        self._queue: queue.Queue[list[Metric] | None] = queue.Queue()
        self._failures = 0
        self._thread = threading.Thread(target=self._send_forever, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def _last_logged_step(self) -> int:
        """-1 for a new run; after a restart, the last step an earlier attempt logged."""
        steps = [m.step for key in ("train_loss", "eval_loss") for m in self.client.get_metric_history(self.run_id, key)]
        return max(steps, default=-1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._queue.put([Metric(k, float(v), now, step) for k, v in metrics.items()])

    def _send_forever(self) -> None:
        while (batch := self._queue.get()) is not None:
            while True:
                try:
                    self.client.log_batch(self.run_id, metrics=batch)
                    break
                except Exception as e:  # the server being down must not end training
                    self._failures += 1
                    if self._failures == 1 or self._failures % 30 == 0:
                        log.warning("MLflow unreachable (%s failures so far), retrying: %s", self._failures, e)
                    time.sleep(self.retry_seconds)

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def close(self, timeout: float = 60.0) -> None:
        """Send what is queued (waiting at most `timeout` seconds)."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("MLflow metrics not fully sent after %.0fs; %d batches dropped",
                        timeout, self._queue.qsize())


def final_metrics(tracking_uri: str, run_id: str) -> dict[str, float]:
    """The latest value of every metric of the run."""
    return dict(MlflowClient(tracking_uri).get_run(run_id).data.metrics)

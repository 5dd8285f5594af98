"""Rank 0's handle on the MLflow run: a tracking server that is slow or down never stalls training.

Metrics and params are queued and sent in batches by a background thread; the training loop only
appends to the queue. While the server is unreachable the thread retries the oldest batch. End-of-run
uploads (the adapter, the sample table) are tried a bounded number of times. Whatever could not be sent
is written to the run directory's journal (app/tracking/journal.py), which `python -m jobs.sync` replays
once the server is back: nothing is lost, and no MLflow call ever runs while other ranks wait in a collective.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from app.errors import first_line, warn
from app.runs.layout import SAMPLES, RunDir
from app.tracking.journal import Journal, is_valid_name

MAX_PARAM_CHARS = 6000


def bound_http_calls() -> None:
    """MLflow retries a failing call 7 times with a 120 s timeout by default: one end-of-run call could
    then hold a job for many minutes. These bounds apply unless the environment sets its own."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")


@dataclass
class _Batch:
    metrics: list[Metric] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)


class RunLogger:
    def __init__(self, tracking_uri: str, run_id: str, run_dir: RunDir | None = None, retry_seconds: float = 2.0,
                 logged_through: int | None = None):
        """`logged_through`: the step after which this attempt's figures are new (default: the last the run
        logged); earlier ones are a restarted attempt's replay of steps already logged, and dropped."""
        bound_http_calls()
        self.client, self.run_id, self.run_dir = MlflowClient(tracking_uri), run_id, run_dir
        self.journal = Journal(run_dir) if run_dir is not None else None
        self.retry_seconds, self.failures, self._failing_in_a_row = retry_seconds, 0, 0
        self._logged_through = logged_through  # if None, found by the sender before it sends anything
        self._queue: queue.Queue[_Batch | None] = queue.Queue()
        self._pending: _Batch | None = None  # the batch being sent
        self._queued = self._handled = 0  # batches put on the queue (by the recipe), and sent or skipped (sender)
        self._refused: set[str] = set()  # names MLflow refused, warned of once
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._send_forever, name="mlflow-metrics", daemon=True)
        self._thread.start()

    # -- what the recipe calls ---------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int, once_per_step: bool = True) -> None:
        """`once_per_step`: dropped if an earlier attempt of this run already logged this step, so a
        restarted run has one value per step."""
        now = int(time.time() * 1000)
        batch = _Batch(metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])
        self._queued += 1
        self._queue.put((batch, step if once_per_step else None))

    def log_params(self, params: dict[str, object]) -> None:
        self._queued += 1
        self._queue.put((_Batch(params=[Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]), None))

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        """Upload a folder that the run directory also holds under `artifact_path`."""
        if not self._with_retries(lambda: self.client.log_artifacts(self.run_id, str(local_dir), artifact_path),
                                  f"artifacts {artifact_path}") and self.journal:
            self.journal.add_artifacts(artifact_path, artifact_path)

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        if self.run_dir is not None:
            self.run_dir.write_text(json.dumps(data), SAMPLES)
        if not self._with_retries(lambda: self.client.log_table(self.run_id, data=data, artifact_file=artifact_file),
                                  f"table {artifact_file}") and self.journal:
            self.journal.add_table(SAMPLES, artifact_file)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until what is queued has been sent (at most `timeout` seconds, less once the server has failed
        three times in a row): before a point where the process may be stopped from outside."""
        deadline = time.monotonic() + timeout
        while (self._queued > self._handled and self._thread.is_alive() and time.monotonic() < deadline
               and self._failing_in_a_row < 3):
            time.sleep(0.05)

    def close(self, timeout: float = 60.0) -> None:
        """Send what is queued, waiting at most `timeout` seconds (less once the server has failed three
        times in a row: it is down, waiting longer only delays the job); journal what was not sent."""
        self._queue.put(None)
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline and self._failing_in_a_row < 3:
            self._thread.join(0.5)
        self._stopping.set()  # the sender takes no new batch now; one it is sending may still land
        self._thread.join(self.retry_seconds + float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")))
        unsent = ([self._pending] if self._pending else []) + [item[0] for item in _drain(self._queue) if item]
        metrics, params = [m for b in unsent for m in b.metrics], [p for b in unsent for p in b.params]
        if self.journal and (metrics or params):
            self.journal.add_metrics_and_params(metrics, params)
            warn(f"MLflow: {len(metrics) + len(params)} unsent records written to {self.journal.location}")
        if self.failures:
            warn(f"MLflow was unreachable for {self.failures} calls during this run")
            self._with_retries(lambda: self.client.set_tag(self.run_id, "mlflow_failed_calls", str(self.failures)),
                               "the outage tag", attempts=1)

    # -- the sender ----------------------------------------------------------------------------------------

    def _send_forever(self) -> None:
        if self._logged_through is None:
            self._logged_through = self._last_logged_step()
        while not self._stopping.is_set() and (item := self._queue.get()) is not None:
            batch, step = item
            if step is None or step > self._logged_through:
                self._pending = batch
                while not self._send(batch):
                    if self._stopping.wait(self.retry_seconds):
                        return
                self._pending = None
            self._handled += 1

    def _send(self, batch: _Batch) -> bool:
        try:
            self.client.log_batch(self.run_id, metrics=batch.metrics, params=batch.params)
            self._failing_in_a_row = 0
            return True
        except MlflowException as e:
            if e.error_code == "INVALID_PARAMETER_VALUE":  # rejected, not unreachable: retrying it cannot help
                return self._send_what_is_taken(batch, e)
            self._report_failure(e)
        except Exception as e:  # the server being down must not end training
            self._report_failure(e)
        return False

    def _send_what_is_taken(self, batch: _Batch, rejection: MlflowException) -> bool:
        """A batch MLflow refused: sent again without the metrics and params whose names it refuses, then (if it
        still refuses) without the params (one the run holds another value of); what is left out is warned of
        once per name. Every other figure of the step still lands."""
        metrics = [m for m in batch.metrics if is_valid_name(m.key)]
        params = [p for p in batch.params if is_valid_name(p.key)]
        for keep in (_Batch(metrics, params), _Batch(metrics, [])):
            left_out = [x.key for x in batch.metrics + batch.params if x not in keep.metrics + keep.params]
            if not (keep.metrics or keep.params):
                break
            try:
                self.client.log_batch(self.run_id, metrics=keep.metrics, params=keep.params)
            except MlflowException as e:
                if e.error_code != "INVALID_PARAMETER_VALUE":
                    self._report_failure(e)
                    return False
                rejection = e
                continue
            for name in sorted(set(left_out) - self._refused):
                warn(f"MLflow refuses {name!r} ({first_line(rejection, 200)}); it is left out, the rest is logged")
            self._refused |= set(left_out)
            self._failing_in_a_row = 0
            return True
        warn(f"MLflow rejected a batch ({first_line(rejection, 200)}); it is dropped")
        return True

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
        self._failing_in_a_row += 1
        if self.failures == 1 or self.failures % 30 == 0:
            warn(f"MLflow unreachable ({self.failures} failed calls so far); what it misses is kept and retried: "
                 f"{first_line(error, 200)}")

    def _with_retries(self, call, what: str, attempts: int = 3) -> bool:
        if self._failing_in_a_row >= 3:  # the server is down: keep it for `jobs.sync` without waiting
            warn(f"MLflow: {what} not sent (the server is unreachable); kept for `python -m jobs.sync`")
            return False
        for attempt in range(attempts):
            try:
                call()
                self._failing_in_a_row = 0
                return True
            except Exception as e:
                self._report_failure(e)
                if attempt < attempts - 1:
                    time.sleep(self.retry_seconds * (attempt + 1))
        warn(f"MLflow: could not log {what}; it is kept in the run directory for `python -m jobs.sync`")
        return False


def _drain(q: queue.Queue):
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return

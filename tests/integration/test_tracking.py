"""MLflow tracking against a real `mlflow server`: dataset inputs, sweep grouping, and a server that
stops answering mid-run (SIGSTOP on the server's processes: requests hang, as on a dead host)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from app.data.sources import resolve_source, source_digest
from app.runs.layout import JOURNAL, RunDir
from app.tracking import mlflow_run as tracking
from app.tracking.logger import RunLogger
from tests.helpers import make_config, start_mlflow_server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server, uri = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    MlflowClient(uri).create_experiment("outage")  # the first store request is slow: made here, with default timeouts
    yield uri, psutil.Process(server.pid)
    for proc in [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]:
        proc.send_signal(signal.SIGCONT)
        proc.kill()


def _pause(server: psutil.Process, sig: int) -> None:
    for proc in [server, *server.children(recursive=True)]:
        proc.send_signal(sig)


def fail_fast_http(monkeypatch) -> None:
    """MLflow's own HTTP retries would hide the outage for minutes; the logger's retries are under test."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def _new_run(uri: str) -> str:
    client = MlflowClient(uri)
    return client.create_run(client.get_experiment_by_name("outage").experiment_id).info.run_id


def _steps(uri: str, run_id: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "train_loss"))


def test_metrics_logged_while_the_server_hangs_arrive_once_it_answers_again(mlflow_server, monkeypatch, tmp_path):
    uri, server = mlflow_server
    run_id = _new_run(uri)
    fail_fast_http(monkeypatch)
    logger = RunLogger(uri, run_id, RunDir(str(tmp_path)), retry_seconds=0.5)
    for step in (1, 2, 3):
        logger.log_metrics({"train_loss": 1.0 / step}, step)
    _pause(server, signal.SIGSTOP)
    try:
        for step in (4, 5, 6):  # queued: the training loop never waits on the server
            logger.log_metrics({"train_loss": 1.0 / step}, step)
        deadline = time.time() + 30
        while logger.failures < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert logger.failures >= 2  # the outage was seen and retried
    finally:
        _pause(server, signal.SIGCONT)
    logger.close(timeout=60)
    assert _steps(uri, run_id) == [1, 2, 3, 4, 5, 6]
    assert int(MlflowClient(uri).get_run(run_id).data.tags["mlflow_failed_calls"]) >= 2
    assert not (tmp_path / JOURNAL).exists()


def test_metrics_the_server_never_takes_are_kept_on_disk(mlflow_server, monkeypatch, tmp_path):
    uri, server = mlflow_server
    run_id = _new_run(uri)
    fail_fast_http(monkeypatch)
    logger = RunLogger(uri, run_id, RunDir(str(tmp_path)), retry_seconds=0.5)
    _pause(server, signal.SIGSTOP)
    try:
        for step in (1, 2):
            logger.log_metrics({"train_loss": 0.5, "grad_norm": 1.0}, step)
        logger.close(timeout=3)
    finally:
        _pause(server, signal.SIGCONT)
    kept = [json.loads(line) for line in (tmp_path / JOURNAL).read_text().splitlines()]
    assert sorted((k["metric"], k["step"]) for k in kept) == [("grad_norm", 1), ("grad_norm", 2),
                                                          ("train_loss", 1), ("train_loss", 2)]


def test_a_run_records_its_data_as_dataset_inputs_and_its_sweep(mlflow_server, embedded, tmp_path):
    uri, _ = mlflow_server
    cfg = make_config(tmp_path, embedded, f"mlflow.tracking_uri={uri}", "mlflow.sweep=s1", "train.run_name=r1")
    parent = _new_run(uri)
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"parent_run_id": parent})})
    train, eval_ = resolve_source(cfg.data.train_path), resolve_source(cfg.data.eval_path)
    run_id = tracking.start_run(cfg, {"base_model": cfg.model.path}, {}, [("train", train, source_digest(train)),
                                                                           ("eval", eval_, source_digest(eval_))])
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.tags["sweep"] == "s1" and run.data.tags["mlflow.parentRunId"] == parent
    inputs = {d.tags[0].value: d.dataset for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"train", "eval"}
    assert json.loads(inputs["train"].source)["uri"] == Path(cfg.data.train_path).as_uri()
    assert inputs["train"].digest != inputs["eval"].digest

    copied, changed = tmp_path / "copy.jsonl", tmp_path / "changed.jsonl"  # the digest follows the bytes
    original = Path(cfg.data.train_path).read_text()
    copied.write_text(original)
    changed.write_text(original + original.splitlines()[0] + "\n")
    assert source_digest(resolve_source(str(copied))) == inputs["train"].digest
    assert source_digest(resolve_source(str(changed))) != inputs["train"].digest

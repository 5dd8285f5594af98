"""A run keeps what it made when things go wrong: a tracking server that dies and never comes back, two jobs
started with one run name, an adapter export that was interrupted, an object store that fails a checkpoint's
writes, a data file deleted mid-run or changed before a resume. Real Ray, a real `mlflow server` (killed with
SIGKILL), a local S3 server (moto) behind a proxy that fails writes, real jobs (`python -m jobs.finetune`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load

from app.launch.driver import run_finetune
from tests.helpers import (
    EMBEDDED_CONFIG,
    NO_DECODING,
    REPO,
    FailingWrites,
    free_port,
    job_command,
    make_config,
    start_mlflow_server,
)

pytestmark = pytest.mark.e2e
QUICK = ["train.max_steps=12", "train.eval_every=12", "train.checkpoint_every=4", "train.log_every=1",
         "train.sample_prompts=2", "train.sample_max_new_tokens=4", *NO_DECODING]
# The outage and S3 jobs: what they show does not depend on the worker count (one against two workers is
# test_e2e's), and each starts its own Ray cluster: a worker process less to start.
ONE_WORKER = "scaling.num_workers=1"


def start_mlflow(root: Path) -> tuple[subprocess.Popen, str]:
    return start_mlflow_server(root, start_new_session=True)  # its own process group: killed as one


@pytest.mark.extended  # a hanging server's metrics arriving later runs in CI (test_tracking.py)
def test_a_tracking_server_lost_for_good_costs_the_run_nothing_and_sync_sends_the_rest(embedded, tmp_path):
    """The tracking server is SIGKILLed mid-run: the job still finishes with its adapter and journals what
    it could not send; once a server is back on the same store, `jobs.sync` sends the rest."""
    server, uri = start_mlflow(tmp_path / "mlflow")
    out, run_name = tmp_path / "outputs", "outage"
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
    job = subprocess.Popen(job_command(embedded, out, *QUICK, ONE_WORKER, f"mlflow.tracking_uri={uri}",
                                       f"train.run_name={run_name}"), cwd=REPO, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not list((out / run_name).glob("checkpoint_*")) and time.time() < deadline:  # training is under way
        time.sleep(0.5)
    os.killpg(server.pid, signal.SIGKILL)  # the server and its workers, for good
    stdout, stderr = job.communicate(timeout=600)
    assert job.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])  # the summary is still the last line
    assert summary["steps"] == 12 and summary["mlflow_synced"] is False
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    adapter = Path(summary["adapter_path"])
    assert (adapter / "COMPLETE").exists() and (adapter / "adapter_model.safetensors").exists()
    journal = [json.loads(line) for line in (out / run_name / "unsent.jsonl").read_text().splitlines()]
    assert {"status": "FINISHED"} in journal and any(e.get("artifacts") == "adapter" for e in journal)
    assert "unsent records written to" in stderr or "could not log" in stderr

    server, uri = start_mlflow(tmp_path / "mlflow")  # back, on the same store
    try:
        synced = subprocess.run([sys.executable, "-m", "jobs.sync", run_name, "--config", str(EMBEDDED_CONFIG),
                                 "--set", f"train.output_dir={out}", "--set", f"mlflow.tracking_uri={uri}"],
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        assert synced.returncode == 0, synced.stderr[-3000:]
        client = MlflowClient(uri)
        run = client.get_run(summary["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss")) == list(range(1, 13))
        assert run.data.metrics["final_eval_loss"] == pytest.approx(summary["final_eval_loss"])
        assert "adapter/adapter_model.safetensors" in {f.path for f in client.list_artifacts(run.info.run_id,
                                                                                              "adapter")}
        assert not (out / run_name / "unsent.jsonl").exists()
    finally:
        os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.extended  # one writer at a time, a dead writer's claim taken over: tests/unit/runs/test_runs.py
def test_two_jobs_with_one_run_name_one_runs_and_the_other_stops_at_once(ray_cluster, embedded, tmp_path):
    """Two jobs started with one run name: one here, and while it holds the run a second one, as a
    `python -m jobs.finetune` process. The second stops at once with one line naming the job that holds the
    run; the first finishes, there is one MLflow run of that name, and the claim on the run is released."""
    cfg = make_config(tmp_path, embedded, *QUICK, "train.run_name=twins")
    results: list[dict] = []
    first = threading.Thread(target=lambda: results.append(run_finetune(cfg)))
    first.start()
    deadline = time.time() + 120
    while not Path(cfg.run_dir.path("writer.json")).exists() and time.time() < deadline:
        time.sleep(0.1)
    second = subprocess.run(job_command(embedded, tmp_path / "outputs", *QUICK, "train.run_name=twins"),
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    first.join(timeout=600)
    assert second.returncode == 2
    assert second.stderr.startswith("error: train.run_name=twins: another job (pid") and second.stderr.count("\n") == 1
    assert results and results[0]["steps"] == 12
    client = MlflowClient(cfg.mlflow.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id],
                              "attributes.run_name = 'twins'")
    assert len(runs) == 1  # the second job left no orphan MLflow run
    assert not Path(cfg.run_dir.path("writer.json")).exists()  # released at the end


@pytest.fixture
def s3_bucket(tmp_path):
    """A local S3 server (moto), standing in for a cloud bucket, which cannot be reached here. Jobs reach
    it through pyarrow's filesystems, as they would reach AWS: only the endpoint differs."""
    import boto3

    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for _ in range(60):
        try:
            boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                         aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket="runs")
            break
        except Exception:
            time.sleep(0.5)
    yield env
    os.killpg(server.pid, signal.SIGKILL)


CHECKPOINT_FOLDER = re.compile(r"/checkpoint_\d{4}-[^/]+/")  # Ray Train's, named by their time


@pytest.mark.extended
def test_a_run_on_s3_outlives_failed_checkpoint_writes_and_its_data_vanishing_and_resumes_only_on_its_data(
        embedded, tmp_path, s3_bucket, monkeypatch):
    """A job with an s3:// output dir writes its run there (never a local folder). The store fails every write of
    its second checkpoint, and its data file is deleted once training is under way: Ray Train restarts the worker
    group from the first checkpoint (every step logged once), and the run, which read its data once, finishes its
    passes. A resume then refuses the data vanished or changed, in one line before Ray starts, and on the data put
    back redoes an interrupted export there, bit for bit."""
    import pyarrow.fs as pafs

    checkpoints: list[str] = []

    def second_checkpoint(path: str) -> bool:
        folder = CHECKPOINT_FOLDER.search(path)
        if folder and folder.group() not in checkpoints:
            checkpoints.append(folder.group())
        return bool(folder) and checkpoints.index(folder.group()) == 1

    store = FailingWrites(s3_bucket["AWS_ENDPOINT_URL"], second_checkpoint)
    env = {**os.environ, **s3_bucket, "AWS_ENDPOINT_URL": store.url}
    data = tmp_path / "train.jsonl"  # 64 records: a pass takes a few steps, so the run makes several
    rows = Path(embedded["train"]).read_text().splitlines(keepends=True)[:64]
    data.write_text("".join(rows))
    tracking = f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    command = job_command(embedded, "s3://runs/finetune", *QUICK, ONE_WORKER, f"data.train_path={data}", tracking,
                          "train.max_failures=1", "train.run_name=on-s3")
    job = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not checkpoints and job.poll() is None:  # the first checkpoint is being written: training is under way
        time.sleep(0.2)
    data.unlink()
    stdout, stderr = job.communicate(timeout=600)
    assert job.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["adapter_path"] == "s3://runs/finetune/on-s3/adapter" and summary["steps"] == 12
    assert summary["model_uri"].startswith("models:/") and "warning: MLflow" not in stderr  # logged from the bucket
    assert store.failed and len(checkpoints) >= 3  # the failed one, and the ones after the restart
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "train_loss")] == list(range(1, 13))
    per_pass = client.get_metric_history(summary["mlflow_run_id"], "data_rows_per_worker_per_pass")[0].value
    assert 3 * per_pass < 12 * 32  # a step takes 32 rows: the run took more than 3 passes

    for key, value in s3_bucket.items():
        monkeypatch.setenv(key, value)
    s3, _ = pafs.FileSystem.from_uri("s3://runs")
    names = {i.base_name for i in s3.get_file_info(pafs.FileSelector("runs/finetune/on-s3"))}
    assert {"run.json", "adapter"} <= names and any(n.startswith("checkpoint_") for n in names)
    assert not (Path(REPO) / "s3:").exists()  # never a local folder named after the scheme
    weights = "runs/finetune/on-s3/adapter/adapter_model.safetensors"
    exported = load(s3.open_input_stream(weights).read())
    s3.delete_file("runs/finetune/on-s3/adapter/COMPLETE")  # as if the export had been cut short halfway
    with s3.open_output_stream(weights) as half_written:
        half_written.write(b"\0" * 100)

    resume = lambda: subprocess.run([*command, "--resume", "on-s3"], cwd=REPO, env=env, capture_output=True,
                                    text=True, timeout=600)
    vanished = resume()
    assert vanished.returncode == 2 and vanished.stderr == f"error: data.train_path={data}: no such file or " \
                                                           "directory; for the embedded demo data run `make embedded`\n"
    data.write_text("".join(rows[:-1]))  # a record less
    changed = resume()
    assert changed.returncode == 2 and changed.stderr.count("\n") == 1
    assert changed.stderr.startswith(f"error: --resume: data.train_path={data} changed since run on-s3 started")
    data.write_text("".join(rows))  # put back as it was
    resumed = resume()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert again["mlflow_run_id"] == summary["mlflow_run_id"] and again["steps"] == 12
    assert s3.get_file_info("runs/finetune/on-s3/adapter/COMPLETE").type == pafs.FileType.File
    again = load(s3.open_input_stream(weights).read())  # the same adapter, bit for bit
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in exported)

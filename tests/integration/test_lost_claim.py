"""A job whose claim on its run is taken over (it was cut off from the storage past its lease, and another job
took the run) stops with one line and writes nothing more: no later checkpoint, its MLflow run left to the new
owner, the new owner's claim left in place. Real Ray Train, a real claim file, a real MLflow store."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from app.errors import UserInputError
from app.launch.driver import run_finetune
from app.runs.claim import this_process
from tests.faults import STEP_SECONDS, inject
from tests.helpers import NO_DECODING, make_config

# extended: two jobs with one run name, one stopping at once, runs in CI (test_run_safety.py)
pytestmark = [pytest.mark.e2e, pytest.mark.extended]


def test_a_job_that_loses_its_claim_stops_and_leaves_the_run_to_the_new_owner(ray_cluster, embedded, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setattr("app.runs.claim.LEASE_SECONDS", 2.0)  # renewed (and checked) every 0.2 s
    inject(monkeypatch, STEP_SECONDS, "0.5")  # a run long enough to lose its claim in
    cfg = make_config(tmp_path, embedded, "train.max_steps=40", "train.checkpoint_every=2", "train.eval_every=40",
                      "train.run_name=taken", *NO_DECODING)
    run_dir = Path(cfg.run_dir.root)
    other = subprocess.Popen(["sleep", "300"])  # the job that takes the run over: a live process of this host
    taken_at: list[float] = []

    def take_over() -> None:
        while not list(run_dir.glob("checkpoint_*")):
            time.sleep(0.2)
        owner = this_process() | {"pid": other.pid, "started": psutil.Process(other.pid).create_time()}
        (run_dir / "writer.json").write_text(json.dumps(owner))
        taken_at.append(time.time())

    threading.Thread(target=take_over, daemon=True).start()
    try:
        with pytest.raises(UserInputError) as error:
            run_finetune(cfg)
        message = str(error.value)
        assert "this job's claim on the run was taken over by another job" in message and "\n" not in message
        assert f"pid {other.pid}" in message
        assert json.loads((run_dir / "writer.json").read_text())["pid"] == other.pid  # the new owner's, kept
        run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
        assert MlflowClient(cfg.mlflow.tracking_uri).get_run(run_id).info.status == "RUNNING"  # not ended by us
        time.sleep(3)
        late = [c for c in run_dir.glob("checkpoint_*") if c.stat().st_mtime > taken_at[0] + 2]
        assert not late, late  # the worker group was stopped: nothing written after the loss was seen
        assert not (run_dir / "adapter").exists()
    finally:
        other.kill()

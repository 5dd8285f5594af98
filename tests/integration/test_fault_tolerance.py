"""Checkpoints, restarts and resume on a real embedded Ray cluster: workers are really killed (SIGKILL)."""

import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import ray
import ray.train
from mlflow.tracking import MlflowClient
from ray._private import ray_constants

from app.launch.driver import run_finetune
from tests.faults import DIE_IN_CHECKPOINT, inject
from tests.helpers import SHORT_RUN, make_config

pytestmark = pytest.mark.e2e


def _history(cfg, run_id, key="train_loss") -> dict[int, float]:
    points = MlflowClient(cfg.mlflow.tracking_uri).get_metric_history(run_id, key)
    steps = [m.step for m in points]
    assert len(steps) == len(set(steps)), f"{key} has repeated steps: {sorted(steps)}"
    return {m.step: m.value for m in points}


def _training_workers_of_this_session() -> list[psutil.Process]:
    """The training workers of this test session's own Ray cluster: descendants of its raylet (found
    through Ray's private node handle). Processes of other clusters on the machine are never touched."""
    node = ray._private.worker._global_node
    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    return [p for p in raylet.children(recursive=True) if "RayTrainWorker" in " ".join(p.cmdline())]


@pytest.fixture
def decoy():
    """A process that looks like a training worker to anything matching command lines."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "ray::RayTrainWorker"])
    yield process
    process.kill()


def _kill_a_worker_after(cfg, step: int, seen: dict, timeout: float = 240) -> threading.Thread:
    """In the background: wait until MLflow shows `step`, then SIGKILL one training worker process.

    `seen["step"]` gets the last step logged when the kill was sent."""
    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cfg.run_dir.has_record():
                run_id = cfg.run_dir.recorded_mlflow_run_id()
                steps = [m.step for m in MlflowClient(cfg.mlflow.tracking_uri).get_metric_history(run_id, "train_loss")]
                if max(steps, default=0) >= step:
                    victims = _training_workers_of_this_session()
                    assert victims, "no training worker process found"
                    victims[-1].send_signal(signal.SIGKILL)
                    seen["step"] = max(steps)
                    return
            time.sleep(0.2)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_crash_mid_save_and_a_killed_worker_both_resume_and_the_run_finishes_without_losing_steps(
        reference_run, embedded, tmp_path, decoy, monkeypatch):
    """One run survives two failures, each restarting the worker group from the latest whole checkpoint:
    a worker dying while saving checkpoint 12 (the torn checkpoint is never used: it resumes from 6), then
    a worker SIGKILLed later on. Every step is logged once, the restarted workers carry on trained, and
    the run ends like an uninterrupted one. Only this session's own worker processes are killed."""
    marker = tmp_path / "fault-fired"
    inject(monkeypatch, DIE_IN_CHECKPOINT, f"12:{marker}")  # the last rank dies mid-save at step 12, once
    cfg = make_config(tmp_path, embedded, *SHORT_RUN, "train.max_failures=2", "train.run_name=killed")
    seen = {}
    # steps past 12 are first logged after the restart from checkpoint 6 (a restarted attempt does not log
    # again the steps 7..12 an earlier attempt logged), so the kill can only land in the second attempt
    killer = _kill_a_worker_after(cfg, step=15, seen=seen, timeout=900)
    summary = run_finetune(cfg)
    killer.join()
    run_id = summary["mlflow_run_id"]
    assert marker.exists(), "the worker never died mid-save"
    assert "step" in seen, "no worker was killed"
    losses = _history(cfg, run_id)
    assert sorted(losses) == list(range(1, 31))  # exactly max_steps steps, each logged once
    resumed = _history(cfg, run_id, "resumed_from_step")
    assert len(resumed) == 2, f"expected two worker-group restarts, got {resumed}"
    assert all(value == step for step, value in resumed.items())
    after_torn_save, after_kill = sorted(resumed)
    assert after_torn_save == 6  # the checkpoint before the torn one
    assert after_kill % 6 == 0 and after_torn_save < after_kill <= seen["step"]
    after_restart = [losses[s] for s in range(seen["step"] + 1, seen["step"] + 5)]  # the new workers' first steps
    assert max(after_restart) < 0.7 * losses[1], "after the restart the loss started over from the untrained value"
    assert MlflowClient(cfg.mlflow.tracking_uri).get_run(run_id).info.status == "FINISHED"
    assert summary["final_eval_loss"] == pytest.approx(reference_run[1]["final_eval_loss"], rel=0.1)
    assert len(cfg.run_dir.checkpoints()) == cfg.train.keep_checkpoints
    assert decoy.poll() is None  # only this session's own worker was killed


@pytest.mark.extended  # make test resumes a data pass on other worker counts (test_data_pipeline.py)
def test_a_crashed_run_resumes_on_fewer_workers_and_ends_near_an_uninterrupted_one(reference_run, embedded, tmp_path):
    """A run that fails for good (no restarts allowed) is resumed by a new job on one worker instead of two:
    it carries on from its last checkpoint in the same MLflow run and ends near the uninterrupted run."""
    crashed = make_config(tmp_path, embedded, *SHORT_RUN, "train.max_failures=0", "train.run_name=crashed")
    killer = _kill_a_worker_after(crashed, step=15, seen={})
    with pytest.raises(ray.train.TrainingFailedError):
        run_finetune(crashed)
    killer.join()
    run_id = crashed.run_dir.recorded_mlflow_run_id()
    assert MlflowClient(crashed.mlflow.tracking_uri).get_run(run_id).info.status == "FAILED"

    resumed = run_finetune(make_config(tmp_path, embedded, *SHORT_RUN, "train.run_name=crashed",
                                       "scaling.num_workers=1"), resume=True)
    reference = reference_run[1]
    assert resumed["mlflow_run_id"] == run_id and resumed["steps"] == 30
    assert sorted(_history(crashed, run_id)) == list(range(1, 31))
    assert _history(crashed, run_id, "resumed_from_step") == {12: 12.0}
    assert resumed["final_eval_loss"] == pytest.approx(reference["final_eval_loss"], rel=0.1)
    assert resumed["initial_eval_loss"] == pytest.approx(reference["initial_eval_loss"], rel=1e-3)
    assert MlflowClient(crashed.mlflow.tracking_uri).get_run(run_id).data.tags["resumes"] == "1"


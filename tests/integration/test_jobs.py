"""Ray Jobs against a real local stack: `cluster/local-up.sh` (a `ray start --head` with token auth and
an MLflow server with proxied artifacts, both on loopback), driven through `python -m jobs.submit`.

Nothing is mocked. The stack runs on free ports in its own temp dir, beside the test session's
embedded cluster, and `cluster/local-down.sh` stops only it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import REPO, free_port

pytestmark = pytest.mark.e2e
HF_SENTINEL = "hf_test_token_do_not_log_4f2a"  # stands in for a real hub token
QUICK = ["train.max_steps=6", "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
         "train.warmup_steps=1", "train.sample_prompts=2", "train.sample_max_new_tokens=8"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded):
    stack_dir = tmp_path_factory.mktemp("stack")
    names = ("RAY_PORT", "DASHBOARD_PORT", "MLFLOW_PORT", "AGENT_PORT", "CLIENT_PORT")
    ports = {name: str(free_port()) for name in names}
    env = {**os.environ, **ports, "STACK_DIR": str(stack_dir), "BIN": str(Path(sys.executable).parent),
           "RAY_TMP": f"/tmp/ray-test-{ports['RAY_PORT']}", "HF_TOKEN": HF_SENTINEL}
    up = subprocess.run(["bash", "cluster/local-up.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert up.returncode == 0, up.stderr + (stack_dir / "ray-start.log").read_text()
    mlflow_uri = f"http://127.0.0.1:{ports['MLFLOW_PORT']}"
    client_env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": f"http://127.0.0.1:{ports['DASHBOARD_PORT']}"}
    client_env.pop("HF_TOKEN", None)  # the client never has it; only the cluster's environment does
    data = [f"model.path={embedded['model']}", f"data.train_path={embedded['train']}",
            f"data.eval_path={embedded['eval']}", f"train.output_dir={stack_dir / 'outputs'}",
            f"mlflow.tracking_uri={mlflow_uri}"]
    yield {"env": client_env, "mlflow": mlflow_uri, "data": data, "dir": stack_dir, "raytmp": env["RAY_TMP"]}
    subprocess.run(["bash", "cluster/local-down.sh"], cwd=REPO, env=env, capture_output=True)


def submit_cli(stack, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.submit", *args], cwd=REPO, env=stack["env"],
                          capture_output=True, text=True, timeout=timeout)


def with_overrides(*overrides: str) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def test_a_submitted_job_succeeds_and_its_run_is_on_the_tracking_server(stack, tmp_path):
    submitted = submit_cli(stack, "submit", "--config", "jobs/configs/embedded.yaml",
                           *with_overrides(*stack["data"], *QUICK, "train.run_name=jobs-api-demo"), "--follow")
    logs = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, logs[-3000:]
    summary = json.loads([line for line in logs.splitlines() if line.startswith('{"mlflow_run_id"')][-1])
    assert "HF_TOKEN is set" in logs and HF_SENTINEL not in logs

    status = submit_cli(stack, "status", "jobs-api-demo")
    assert status.stdout.startswith("jobs-api-demo: SUCCEEDED")
    assert "jobs-api-demo" in submit_cli(stack, "list").stdout

    client = MlflowClient(stack["mlflow"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "jobs-api-demo"
    assert run.data.tags["ray.job_submission_id"] == "jobs-api-demo"
    assert run.data.tags["base_model"] == str(stack["data"][0].split("=", 1)[1])
    assert len(run.data.tags.get("mlflow.source.git.commit", "")) == 40
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(range(1, 7))
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {"train.jsonl", "eval.jsonl"}
    everything = json.dumps({**run.data.params, **run.data.tags})
    assert HF_SENTINEL not in everything
    adapter = {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= adapter
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/sample_generations.json",
                                                      str(tmp_path))).read_text())
    assert table["columns"] == ["prompt", "reference", "generated"] and len(table["data"]) == 2


def _training_processes(run_name: str, ray_tmp: str) -> list[str]:
    """The job's driver (its command line names the run), and any Ray Train actor process of the stack:
    a descendant of the stack's raylet (the test session's own Ray cluster is not looked at)."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            command = " ".join(proc.info["cmdline"] or [])
            if run_name in command and "jobs.finetune" in command:
                left.append(command)
            elif "raylet" in command and ray_tmp in command:
                left += [" ".join(child.cmdline()) for child in proc.children(recursive=True)
                         if any(name in " ".join(child.cmdline()) for name in ("RayTrainWorker", "TrainController"))]
        except psutil.NoSuchProcess:
            pass
    return left


def test_a_stopped_job_ends_its_run_killed_keeps_its_checkpoints_and_leaves_no_processes(stack):
    run_name = "jobs-api-stopped"
    submitted = submit_cli(stack, "submit", "--config", "jobs/configs/embedded.yaml",
                           *with_overrides(*stack["data"], "train.max_steps=400", "train.checkpoint_every=3",
                                           f"train.run_name={run_name}"))
    assert submitted.returncode == 0, submitted.stderr
    client = MlflowClient(stack["mlflow"])
    deadline = time.time() + 300
    while time.time() < deadline:  # until it has trained past its first checkpoint
        experiment = client.get_experiment_by_name("embedded-demo")  # created by the job's driver
        runs = client.search_runs(experiment.experiment_id, f"attributes.run_name = '{run_name}'") if experiment else []
        if runs and len(client.get_metric_history(runs[0].info.run_id, "checkpoint_save_seconds")) >= 1:
            break
        time.sleep(2)
    else:
        pytest.fail(submit_cli(stack, "logs", run_name).stdout[-3000:])

    running = _training_processes(run_name, stack["raytmp"])
    assert any("RayTrainWorker" in p for p in running) and any("jobs.finetune" in p for p in running)
    stopped = submit_cli(stack, "stop", run_name, "--wait")
    assert stopped.stdout.strip() == f"{run_name}: STOPPED", stopped.stdout + stopped.stderr
    assert client.get_run(runs[0].info.run_id).info.status == "KILLED"
    assert list((stack["dir"] / "outputs" / run_name).glob("checkpoint_*/*.distcp"))
    deadline = time.time() + 30
    while _training_processes(run_name, stack["raytmp"]) and time.time() < deadline:
        time.sleep(1)
    assert _training_processes(run_name, stack["raytmp"]) == []


def test_a_sweep_runs_each_point_as_a_job_and_compares_them_from_mlflow(stack):
    swept = submit_cli(stack, "sweep", "--config", "jobs/configs/embedded.yaml", "--name", "lr-sweep",
                       "--grid", "train.learning_rate=1e-3,4e-3", *with_overrides(*stack["data"], *QUICK))
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    table = swept.stdout.split("lr-sweep: 2 jobs submitted")[1]
    assert "lr-sweep-0-learning_rate=1e-3" in table and "lr-sweep-1-learning_rate=4e-3" in table
    assert "final_eval_loss" in table

    client = MlflowClient(stack["mlflow"])
    runs = client.search_runs(client.get_experiment_by_name("embedded-demo").experiment_id, "tags.sweep = 'lr-sweep'")
    parent = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parent) == 1 and len(children) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent[0].info.run_id}
    assert {r.data.params["train.learning_rate"] for r in children} == {"0.001", "0.004"}
    assert all(r.info.status == "FINISHED" and "final_eval_loss" in r.data.metrics for r in children)
    assert parent[0].info.status == "FINISHED"
    assert "sweep/results.json" in {f.path for f in client.list_artifacts(parent[0].info.run_id, "sweep")}

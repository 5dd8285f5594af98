"""Ray Jobs against a real local stack: `cluster/local-up.sh` (a `ray start --head` with token auth and
an MLflow server with proxied artifacts, both on loopback), driven by `ray job submit` and
`python -m jobs.submit`, with the default config and no path overrides.

Nothing is mocked. The stack starts from an empty HOME (it makes its own token), runs on free ports in
its own temp dir beside the test session's Ray cluster, and `cluster/local-down.sh` stops only it. Its
tracking URI carries a sentinel password, which must appear nowhere.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import NO_DECODING, REPO, free_port

pytestmark = pytest.mark.e2e
HF_SENTINEL = "hf_test_token_do_not_log_4f2a"  # stands in for a real hub token
MLFLOW_SENTINEL = "mlflow_password_do_not_log_9b3d"  # the MLflow password in the cluster's tracking URI
QUICK = ["train.max_steps=6", "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
         "train.warmup_steps=1", "train.sample_prompts=2", "train.sample_max_new_tokens=8"]
# What the stopped and swept jobs show does not depend on the worker count (the plain submit keeps the
# default config's two; one against two workers is test_e2e's): a worker process less to start per job.
ONE_WORKER = "scaling.num_workers=1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded):
    stack_dir = tmp_path_factory.mktemp("stack")
    names = ("RAY_PORT", "DASHBOARD_PORT", "MLFLOW_PORT", "AGENT_PORT", "CLIENT_PORT")
    ports = {name: str(free_port()) for name in names}
    mlflow_uri = f"http://127.0.0.1:{ports['MLFLOW_PORT']}"
    env = {k: v for k, v in os.environ.items() if k not in ("FINETUNE_STORAGE", "MLFLOW_TRACKING_URI")}
    env |= {**ports, "STACK_DIR": str(stack_dir), "BIN": str(Path(sys.executable).parent), "HOME": "",
            "RAY_TMP": f"/tmp/ray-test-{ports['RAY_PORT']}", "HF_TOKEN": HF_SENTINEL,
            "MLFLOW_TRACKING_URI": mlflow_uri.replace("://", f"://ray-jobs:{MLFLOW_SENTINEL}@")}
    up = subprocess.run(["bash", "cluster/local-up.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert up.returncode == 0, up.stderr + (stack_dir / "ray-start.log").read_text()
    token_file = stack_dir / ".ray" / "auth_token"  # HOME was empty: the stack keeps its token itself
    client_env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token_file.read_text().strip(),
                  "RAY_ADDRESS": f"http://127.0.0.1:{ports['DASHBOARD_PORT']}", "MLFLOW_TRACKING_URI": mlflow_uri}
    client_env.pop("HF_TOKEN", None)  # the client never has it; only the cluster's environment does
    yield {"env": client_env, "mlflow": mlflow_uri, "dir": stack_dir, "raytmp": env["RAY_TMP"],
           "token_file": token_file, "up_env": env, "up_output": up.stdout + up.stderr}
    subprocess.run(["bash", "cluster/local-down.sh"], cwd=REPO, env=env, capture_output=True)


def submit_cli(stack, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.submit", *args], cwd=REPO, env=stack["env"],
                          capture_output=True, text=True, timeout=timeout)


def with_overrides(*overrides: str) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _no_sentinel_in_the_run(client: MlflowClient, run, tmp_path: Path) -> None:
    """Neither secret in the run's params, tags, or any of its artifacts."""
    assert not any(s in json.dumps({**run.data.params, **run.data.tags}) for s in (HF_SENTINEL, MLFLOW_SENTINEL))
    local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id)))
    for file in [p for p in local.rglob("*") if p.is_file()]:
        content = file.read_bytes()
        assert MLFLOW_SENTINEL.encode() not in content and HF_SENTINEL.encode() not in content, file


def test_a_plain_ray_job_submit_of_the_default_config_succeeds_and_outlives_its_working_dir(stack, tmp_path):
    """No path override: the embedded model is built once in the stack's storage, the run is stored there
    (not in Ray's copy of the upload), and no secret shows in logs, job info, params or artifacts."""
    env = {k: v for k, v in stack["env"].items() if k != "MLFLOW_TRACKING_URI"}
    submitted = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "submit", "--working-dir", ".",
                                "--", "python", "-m", "jobs.finetune", "--config", "jobs/configs/embedded.yaml",
                                *with_overrides(*QUICK, *NO_DECODING)], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=900)
    logs = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, logs[-3000:]
    summary = json.loads([line for line in logs.splitlines() if line.startswith('{"mlflow_run_id"')][-1])
    assert summary["tracking_uri"] == stack["mlflow"] and summary["mlflow_synced"] is True
    assert summary["adapter_path"] == str(stack["dir"] / "outputs" / summary["run_name"] / "adapter")
    assert (stack["dir"] / ".cache" / "embedded" / "model" / "config.json").exists()
    packages = [p for p in Path(stack["raytmp"]).glob("session_2*/runtime_resources/working_dir_files/_ray_pkg_*")
                if p.is_dir()]
    assert packages
    for package in packages:
        shutil.rmtree(package)  # what Ray does when it evicts the upload
    assert (Path(summary["adapter_path"]) / "COMPLETE").exists()
    assert (Path(summary["adapter_path"]) / "adapter_model.safetensors").exists()

    job_info = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "list"], env=env,
                              capture_output=True, text=True, check=True).stdout  # entrypoints, runtime envs
    assert "jobs.finetune" in job_info
    assert MLFLOW_SENTINEL not in logs and MLFLOW_SENTINEL not in job_info and HF_SENTINEL not in job_info
    client = MlflowClient(stack["mlflow"])
    _no_sentinel_in_the_run(client, client.get_run(summary["mlflow_run_id"]), tmp_path)


def test_the_stack_made_its_own_token_readable_by_its_user_only(stack):
    assert stat.S_IMODE(stack["token_file"].stat().st_mode) == 0o600
    assert stack["token_file"].read_text().strip() not in stack["up_output"]  # never printed


def _training_processes(run_name: str, ray_tmp: str) -> list[str]:
    """The job's driver (its command line names the run), and any Ray Train actor process of the stack:
    a descendant of the stack's raylet (the test session's own Ray cluster is not looked at)."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        if run_name in command and "jobs.finetune" in command:
            left.append(command)
        elif "raylet" in command and ray_tmp in command:
            left += [child for child in map(_command_line, _children(proc))
                     if any(name in child for name in ("RayTrainWorker", "TrainController"))]
    return left


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _command_line(proc: psutil.Process) -> str:
    """'' for a process that ended meanwhile (one of the raylet's idle workers, say): the others still count."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


@pytest.mark.extended  # a stopped run ending KILLED with its checkpoints kept: tests/unit/runs, test_fault_tolerance
def test_a_stopped_job_ends_its_run_killed_keeps_its_checkpoints_and_leaves_no_processes(stack):
    run_name = "jobs-api-stopped"
    submitted = submit_cli(stack, "submit", "--config", "jobs/configs/embedded.yaml",
                           *with_overrides(*NO_DECODING, ONE_WORKER, "train.max_steps=400", "train.checkpoint_every=3",
                                           f"train.run_name={run_name}"))
    assert submitted.returncode == 0, submitted.stderr
    client = MlflowClient(stack["mlflow"])
    deadline = time.time() + 600  # a loaded 2-core CI machine has taken 330 s to the first checkpoint
    while time.time() < deadline:  # until it has trained past its first checkpoint
        experiment = client.get_experiment_by_name("embedded-demo")  # created by the job's driver
        runs = client.search_runs(experiment.experiment_id, f"attributes.run_name = '{run_name}'") if experiment else []
        if runs and len(client.get_metric_history(runs[0].info.run_id, "checkpoint_save_seconds")) >= 1:
            break
        time.sleep(2)
    else:
        pytest.fail(submit_cli(stack, "logs", run_name).stdout[-3000:])

    running = _training_processes(run_name, stack["raytmp"])
    assert any("RayTrainWorker" in p for p in running) and any("jobs.finetune" in p for p in running), running
    stopped = submit_cli(stack, "stop", run_name, "--wait")
    assert stopped.stdout.strip() == f"{run_name}: STOPPED", stopped.stdout + stopped.stderr
    assert client.get_run(runs[0].info.run_id).info.status == "KILLED"
    logs = submit_cli(stack, "logs", run_name).stdout
    assert "SIGTERM received" not in logs and "PC: @" not in logs  # no C++ stack dump from Ray's core
    progress = [line for line in logs.splitlines() if " | loss " in line]
    assert progress and all(line.startswith("step ") for line in progress)  # bare: no Ray worker prefix
    assert list((stack["dir"] / "outputs" / run_name).glob("checkpoint_*/*.distcp"))
    deadline = time.time() + 30
    while _training_processes(run_name, stack["raytmp"]) and time.time() < deadline:
        time.sleep(1)
    assert _training_processes(run_name, stack["raytmp"]) == []


SWEEP_CHILDREN = ("lr-sweep-0-learning_rate=1e-3", "lr-sweep-1-learning_rate=4e-3")  # submission ids = run names


def _summary_from_the_logs(stack, job_id: str, *flags: str) -> dict:
    """A finished job's logs through `jobs.submit logs`: the hub token reached the job but not its logs;
    returns the JSON summary its driver printed last."""
    shown = submit_cli(stack, "logs", job_id, *flags)
    logs = shown.stdout + shown.stderr
    assert shown.returncode == 0, logs[-3000:]
    assert "HF_TOKEN is set" in logs and HF_SENTINEL not in logs
    return json.loads([line for line in logs.splitlines() if line.startswith('{"mlflow_run_id"')][-1])


def _a_submitted_jobs_run(stack, client: MlflowClient, job_id: str, summary: dict, tmp_path: Path) -> None:
    """The job's run on the tracking server: named after its submission, tagged with the stack's model and
    the commit, its curve, inputs, adapter and scored answers there, no hub token in its params or tags."""
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == job_id
    assert run.data.tags["ray.job_submission_id"] == job_id
    assert run.data.tags["base_model"] == str(stack["dir"] / ".cache" / "embedded" / "model")
    assert len(run.data.tags.get("mlflow.source.git.commit", "")) == 40
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(range(1, 7))
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {"train.jsonl", "eval.jsonl"}
    assert HF_SENTINEL not in json.dumps({**run.data.params, **run.data.tags})
    adapter = {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= adapter
    downloads = tmp_path / run.info.run_id
    downloads.mkdir()
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/sample_generations.json",
                                                      str(downloads))).read_text())
    # the final evaluation's answers, each scored (eval.generation_rows >= train.sample_prompts: decoded there)
    assert table["columns"] == ["prompt", "reference", "generated", "exact_match"] and len(table["data"]) == 2


@pytest.mark.extended  # a plain submit and Tune's sweep run in CI
def test_a_sweep_runs_each_point_as_a_job_and_compares_them_from_mlflow(stack, tmp_path):
    """`jobs.submit sweep`: one job per grid point, grouped under a parent run and compared in a table. Each
    point is also a whole submitted job: it succeeds, its logs (one followed to the end) carry no secret,
    its run is on the tracking server, and its adapter is a registered version tied to that run."""
    swept = submit_cli(stack, "sweep", "--config", "jobs/configs/embedded.yaml", "--name", "lr-sweep",
                       "--grid", "train.learning_rate=1e-3,4e-3",
                       *with_overrides(*QUICK, ONE_WORKER, "eval.generation_rows=2",
                                       "mlflow.registered_model=jobs-api-demo"),
                       timeout=780)  # within pytest's 900 s, with time left for the checks
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    table = swept.stdout.split("lr-sweep: 2 jobs submitted")[1]
    assert all(child in table for child in SWEEP_CHILDREN) and "final_eval_loss" in table
    assert "final_eval_exact_match" in table  # the config's train.best_metric: what the table ranks by

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

    # each point as a submitted job: `logs --follow` of a finished job streams it whole, then returns
    summaries = {SWEEP_CHILDREN[0]: _summary_from_the_logs(stack, SWEEP_CHILDREN[0], "--follow"),
                 SWEEP_CHILDREN[1]: _summary_from_the_logs(stack, SWEEP_CHILDREN[1])}
    assert {s["mlflow_run_id"] for s in summaries.values()} == {r.info.run_id for r in children}
    assert submit_cli(stack, "status", SWEEP_CHILDREN[0]).stdout.startswith(f"{SWEEP_CHILDREN[0]}: SUCCEEDED")
    listed = submit_cli(stack, "list").stdout
    assert all(child in listed for child in SWEEP_CHILDREN)
    # registered on the tracking server: one version per job, each tagged with its own run
    versions = client.search_model_versions("name='jobs-api-demo'")
    assert len(versions) == 2
    by_run = {v.run_id: v for v in versions}
    for job_id, summary in summaries.items():
        _a_submitted_jobs_run(stack, client, job_id, summary, tmp_path)
        version = by_run[summary["mlflow_run_id"]]
        assert version.tags["run_id"] == summary["mlflow_run_id"] and summary["version"] == version.version


def test_local_down_stops_the_stack_and_nothing_else(stack):
    """A decoy whose command line names the stack's temp dir and a training worker survives: local-down
    stops what local-up recorded (pid and start time) and what those processes started, nothing more."""
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", stack["raytmp"], "RayTrainWorker"])
    try:
        down = subprocess.run(["bash", "cluster/local-down.sh"], cwd=REPO, env=stack["up_env"],
                              capture_output=True, text=True)
        assert down.returncode == 0 and "stopped; data kept in" in down.stdout, down.stdout + down.stderr
        assert decoy.poll() is None
        left = [f'{p.pid} (parent {p.info["ppid"]}): {" ".join(p.info["cmdline"])[:300]}'
                for p in psutil.process_iter(["cmdline", "ppid"])
                if stack["raytmp"] in " ".join(p.info["cmdline"] or []) and p.pid != decoy.pid]
        assert left == [], "\n".join(left)
        for name in ("RAY_PORT", "DASHBOARD_PORT", "CLIENT_PORT", "MLFLOW_PORT"):  # Ray's client server included,
            with pytest.raises(OSError):  # whose command line names no temp dir
                socket.create_connection(("127.0.0.1", int(stack["up_env"][name])), timeout=5).close()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{stack['mlflow']}/health", timeout=5)
        assert (stack["dir"] / "mlflow.db").exists()  # the stack's data is kept
    finally:
        decoy.kill()

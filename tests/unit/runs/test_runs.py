"""Where runs are stored, who writes them, what is kept when MLflow is away, and what never leaks: the
driver-side rules, without a cluster (the integration tests run them for real)."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from app.config.loading import load_config
from app.errors import UserInputError
from app.runs.claim import this_process
from app.runs.layout import RunDir
from tests.helpers import EMBEDDED_CONFIG

SENTINEL = "pw_sentinel_4d1f"


@pytest.fixture
def in_a_ray_job(monkeypatch, tmp_path):
    """What `ray job submit` gives a driver: the job's config in the environment, an unpacked upload as cwd."""
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "j1"}}))
    monkeypatch.delenv("FINETUNE_STORAGE", raising=False)
    upload = tmp_path / "_ray_pkg_1234"
    (upload / "data").mkdir(parents=True)
    (upload / "data" / "mine.jsonl").write_text("{}\n")
    monkeypatch.chdir(upload)
    return upload


def test_in_a_job_nothing_is_written_to_the_uploaded_working_dir(in_a_ray_job, monkeypatch, tmp_path):
    with pytest.raises(UserInputError, match=r"train.output_dir=outputs is relative, and under `ray job submit` "
                                             r"that is Ray's temporary copy"):
        load_config(EMBEDDED_CONFIG)
    monkeypatch.setenv("FINETUNE_STORAGE", str(tmp_path / "shared"))
    cfg = load_config(EMBEDDED_CONFIG, ["data.train_path=data/mine.jsonl"])
    assert cfg.train.output_dir == str(tmp_path / "shared" / "outputs")
    assert cfg.model.path == str(tmp_path / "shared" / ".cache" / "embedded" / "model")  # not uploaded: shared
    assert cfg.data.train_path == str(in_a_ray_job / "data" / "mine.jsonl")  # uploaded with the job: read there


def test_a_uri_output_dir_stays_a_uri_and_needs_a_tracking_server(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserInputError, match=r"train.output_dir=s3://bucket/runs is a URI, where no local MLflow"):
        load_config(EMBEDDED_CONFIG, ["train.output_dir=s3://bucket/runs"])
    cfg = load_config(EMBEDDED_CONFIG, ["train.output_dir=s3://bucket/runs", "train.run_name=r1",
                                        "mlflow.tracking_uri=http://mlflow:5000"])
    assert cfg.train.output_dir == "s3://bucket/runs" and cfg.run_dir.root == "s3://bucket/runs/r1"


def test_a_job_entrypoint_never_carries_credentials():
    from jobs.submit import refuse_secrets

    refuse_secrets(["mlflow.tracking_uri=http://mlflow:5000"])
    with pytest.raises(UserInputError, match="it holds credentials, which would be visible in the job's entrypoint"):
        refuse_secrets([f"mlflow.tracking_uri=http://u:{SENTINEL}@mlflow:5000"])


@pytest.mark.parametrize("override, message", [
    ("train.run_name=../other", r"train.run_name=../other: use letters, digits"),
    ("train.run_name=a/b", r"train.run_name=a/b: use letters, digits"),
    ("train.run_name=a..b", r"train.run_name=a..b: use letters, digits"),
    ("train.max_steps=[1, 2", r"--set train.max_steps=\[1, 2: the value is not valid YAML"),
])
def test_run_names_and_set_values_are_checked(override, message):
    with pytest.raises(UserInputError, match=message) as e:
        load_config(EMBEDDED_CONFIG, [override])
    assert "\n" not in str(e.value)


def test_the_ray_job_id_is_read_in_one_place(in_a_ray_job):
    from app.environment import ray_job_id

    assert ray_job_id() == "j1" and this_process()["ray_job"] == "j1"


def test_an_adapter_is_there_whole_or_not_at_all(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "adapter_model.safetensors").write_bytes(b"weights")
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "adapter_model.safetensors").write_bytes(b"half")  # an interrupted export
    assert not run.adapter_complete()
    run.publish_adapter(staged)
    assert run.adapter_complete()
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["adapter"]  # no partial copy left


def test_a_hub_model_is_pinned_to_the_commit_its_revision_names(monkeypatch):
    """The hub cannot be reached here: its API call is replaced, and only it."""
    from huggingface_hub import HfApi

    from app.plan.model_source import hub_revision_decision

    calls = []

    def model_info(self, repo_id, revision=None):
        calls.append((repo_id, revision))
        if repo_id == "org/missing":
            raise OSError("404 Client Error: Repository Not Found")
        return type("Info", (), {"sha": "a" * 40})()

    monkeypatch.setattr(HfApi, "model_info", model_info)
    cfg = load_config(EMBEDDED_CONFIG, ["model.path=org/model", "model.revision=main"])
    [pinned] = hub_revision_decision(cfg)
    assert (pinned.key, pinned.value) == ("model.revision", "a" * 40) and calls == [("org/model", "main")]
    local = load_config(EMBEDDED_CONFIG)  # a local directory: nothing to resolve
    assert hub_revision_decision(local) == () and len(calls) == 1
    with pytest.raises(UserInputError, match=r"model.path=org/missing: cannot resolve revision main on the hub "
                                             r"\(404 Client Error"):
        hub_revision_decision(load_config(EMBEDDED_CONFIG, ["model.path=org/missing"]))


def test_runs_left_running_by_ended_jobs_are_ended_with_their_jobs_outcome(tmp_path):
    from app.tracking.mlflow_run import reconcile_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    killed = client.create_run(experiment, run_name="a", tags={"ray.job_submission_id": "job-a"}).info.run_id
    alive = client.create_run(experiment, run_name="b", tags={"ray.job_submission_id": "job-b"}).info.run_id
    changed = reconcile_runs(uri, {"job-a": "STOPPED"})
    assert changed == ["MLflow run a: RUNNING -> KILLED (its job job-a is STOPPED)"]
    assert client.get_run(killed).info.status == "KILLED" and client.get_run(alive).info.status == "RUNNING"

"""`python -m jobs.submit`: configs, runtime envs and secrets checked here, before the cluster is contacted
or an MLflow run is created; credentials never in a job's entrypoint, a printed line or a recorded URI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

import jobs.submit
from jobs.submit import main
from tests.helpers import EMBEDDED_CONFIG

PASSWORD = "pw_sentinel_9c2e"


class SucceedingJobs:
    """A Jobs API stand-in: keeps what is submitted; every job has succeeded."""

    def __init__(self):
        self.submitted: list[dict] = []

    def submit_job(self, **job) -> str:
        self.submitted.append(job)
        return job["submission_id"]

    def get_job_status(self, job_id: str):
        return SimpleNamespace(value="SUCCEEDED")


@pytest.fixture
def jobs_api(monkeypatch) -> SucceedingJobs:
    api = SucceedingJobs()
    monkeypatch.setattr(jobs.submit, "job_client", lambda address: api)
    return api


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    """An MLflow file store in tmp_path (a local URI that may carry user:password@); no credentials set."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for variable in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)  # restored after the test, whatever the sweep exported
    return tmp_path / "mlruns"


@pytest.mark.parametrize("command", [["submit"], ["sweep", "--grid", "lora.r=4,8"], ["sync", "r1"]])
def test_a_bad_config_is_refused_before_the_cluster_is_contacted(command, tmp_path, one_line_error,
                                                                 closed_address):
    typo = tmp_path / "typo.yaml"
    typo.write_text("lora:\n  rank: 8\n")
    err = one_line_error(main, ["--address", closed_address, *command, "--config", typo])
    assert f"{typo}: unknown key 'lora.rank'" in err


def test_a_runtime_env_that_is_not_a_mapping_is_one_line(tmp_path, one_line_error, closed_address):
    cases = {"broken.yaml": "env_vars: {A: 1\n", "broken.json": '{"env_vars": ', "list.yaml": "- pip\n- conda\n",
             "env_vars.yaml": "env_vars: [A, B]\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        err = one_line_error(main, ["--address", closed_address, "submit", "--config", EMBEDDED_CONFIG,
                                    "--runtime-env", tmp_path / name])
        assert err.startswith(f"error: --runtime-env {tmp_path / name}: "), err


@pytest.mark.parametrize("item", [f"data.train_path=https://ray:{PASSWORD}@data.example/train.jsonl",
                                  f"model.hf_token={PASSWORD}",
                                  "model.revision=hf_" + "AbCd1234" * 5,
                                  f"data.eval_path=s3://bucket/eval.jsonl?password={PASSWORD}"])
def test_a_secret_in_any_set_value_is_refused_before_the_cluster_is_contacted(item, one_line_error, closed_address):
    err = one_line_error(main, ["--address", closed_address, "submit", "--config", EMBEDDED_CONFIG, "--set", item])
    assert f"--set {item.partition('=')[0]}: it holds credentials" in err and PASSWORD not in err


def test_a_sweep_with_a_password_in_the_tracking_uri_creates_no_run(file_store, jobs_api, capsys):
    uri = f"file://ray:{PASSWORD}@{file_store}"
    code = main(["sweep", "--config", str(EMBEDDED_CONFIG), "--grid", "lora.r=4,8",
                 "--set", f"mlflow.tracking_uri={uri}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --set mlflow.tracking_uri: it holds credentials") and PASSWORD not in err
    assert not file_store.exists() and jobs_api.submitted == []  # no parent run, no orphan, no job


def test_a_sweep_takes_the_credentials_out_of_the_servers_uri_before_recording_it(file_store, jobs_api, capsys,
                                                                                 monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://ray:{PASSWORD}@{file_store}")
    assert main(["sweep", "--config", str(EMBEDDED_CONFIG), "--grid", "lora.r=4,8", "--name", "s1"]) == 0
    out, err = capsys.readouterr()
    assert f"MLflow: file://{file_store}" in out and PASSWORD not in out + err
    assert len(jobs_api.submitted) == 2 and PASSWORD not in repr(jobs_api.submitted)
    [parent] = MlflowClient(f"file://{file_store}").search_runs(
        [MlflowClient(f"file://{file_store}").get_experiment_by_name("embedded-demo").experiment_id])
    assert parent.info.run_name == "s1" and parent.info.status == "FINISHED"
    assert not [f for f in file_store.rglob("*") if f.is_file() and PASSWORD.encode() in f.read_bytes()]


def test_a_tune_sweep_is_checked_here_then_submitted_as_one_job_with_its_name_pinned(jobs_api, one_line_error,
                                                                                        closed_address, capsys):
    """`jobs.submit tune -- FLAGS`: a value no trial could run with is refused before the cluster is contacted;
    a good sweep becomes one `python -m jobs.tune` job whose submission id is the sweep's name (the Jobs API is
    a stand-in: the Ray Tune side is tests/integration/test_tune.py)."""
    err = one_line_error(main, ["--address", closed_address, "tune", "--", "--config", EMBEDDED_CONFIG,
                                "--space", "lora.r=choice(8,0)"])
    assert "tune.space lora.r=choice(8,0) at 0: lora.r: Input should be greater than 0" in err
    assert main(["tune", "--", "--config", str(EMBEDDED_CONFIG), "--space", "lora.r=choice(8,16)",
                 "--scheduler", "asha"]) == 0
    [job] = jobs_api.submitted
    assert job["entrypoint"].startswith("python -m jobs.tune --config ") and "--scheduler asha" in job["entrypoint"]
    assert job["entrypoint"].endswith(f"--name {job['submission_id']}") and job["submission_id"].startswith("tune-")
    assert capsys.readouterr().out.strip() == job["submission_id"]

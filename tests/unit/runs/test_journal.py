"""`python -m jobs.sync`: the journal of a run sent to MLflow, whatever state a crash or a hand edit
left it in. A real sqlite MLflow store in tmp_path."""

from __future__ import annotations

import json

import pytest
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from app.runs.layout import JOURNAL, SAMPLES, RunDir
from app.tracking.journal import Journal
from jobs.sync import main as sync


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run directory recorded against a run of the local MLflow store, as a job leaves it."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text(json.dumps({"mlflow_run_id": run_id}))
    return {"dir": tmp_path / "r", "client": client, "run_id": run_id, "output": tmp_path}


def metric(step: int) -> str:
    return json.dumps({"metric": "train_loss", "value": 1.0 / step, "step": step, "timestamp": 1000 + step})


def synced(run, capsys) -> dict:
    assert sync(["r", "--set", f"train.output_dir={run['output']}"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["sent"]


def test_a_torn_line_is_skipped_counted_and_kept(run, capsys):
    """A crash mid-write leaves half a line; every later sync must still send the rest."""
    torn = '{"metric": "train_loss", "val'
    (run["dir"] / JOURNAL).write_text("\n".join([metric(1), "not json at all", metric(2), torn]))
    sent = synced(run, capsys)
    assert sent == {"metrics and params": 2, "lines skipped (not a journal entry)": 2}
    assert [m.step for m in run["client"].get_metric_history(run["run_id"], "train_loss")] == [1, 2]
    [kept] = run["dir"].glob(f"{JOURNAL}.synced-*")
    assert torn in kept.read_text() and "not json at all" in kept.read_text()
    assert not (run["dir"] / JOURNAL).exists()
    assert synced(run, capsys) == {}


def test_an_entry_kept_after_a_torn_line_starts_a_line_of_its_own(run, capsys):
    (run["dir"] / JOURNAL).write_text(metric(1) + "\n" + '{"metric": "train_lo')
    Journal(RunDir(str(run["dir"]))).add_status("FINISHED")
    assert synced(run, capsys) == {"metrics and params": 1, "lines skipped (not a journal entry)": 1, "statuses": 1}
    assert run["client"].get_run(run["run_id"]).info.status == "FINISHED"


def test_paths_outside_the_run_directory_are_never_read(run, capsys):
    secret = run["output"] / "outside"
    secret.mkdir()
    (secret / "key.txt").write_text("sentinel-3f9a")
    (secret / "table.json").write_text(json.dumps({"k": ["sentinel-3f9a"]}))
    (run["dir"] / "link").symlink_to(secret)
    (run["dir"] / "adapter").mkdir()
    (run["dir"] / "adapter" / "adapter_config.json").write_text("{}")
    (run["dir"] / "adapter" / "escape").symlink_to(secret / "key.txt")
    entries = [{"artifacts": "../outside", "artifact_path": "a"}, {"artifacts": str(secret), "artifact_path": "b"},
               {"artifacts": "link", "artifact_path": "c"}, {"artifacts": "adapter", "artifact_path": "d"},
               {"table": "../outside/table.json", "artifact_file": "t1.json"},
               {"table": str(secret / "table.json"), "artifact_file": "t2.json"},
               {"table": "link/table.json", "artifact_file": "t3.json"}]
    (run["dir"] / JOURNAL).write_text("".join(json.dumps(e) + "\n" for e in [*entries, json.loads(metric(1))]))
    sent = synced(run, capsys)
    assert sent == {"entries refused (a path outside the run directory)": 7, "metrics and params": 1}
    assert run["client"].list_artifacts(run["run_id"]) == []
    assert not any("sentinel-3f9a" in f.read_text() for f in (run["output"] / "mlartifacts").rglob("*") if f.is_file())
    [kept] = run["dir"].glob(f"{JOURNAL}.synced-*")
    assert "../outside" in kept.read_text()


def test_sync_sends_what_the_journal_kept_in_order(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())).info.run_id
    run = RunDir(str(tmp_path / "run"))
    run.write_record(run_id)
    (tmp_path / "run" / "adapter").mkdir()
    (tmp_path / "run" / "adapter" / "adapter_config.json").write_text("{}")
    run.write_text(json.dumps({"prompt": ["p"], "generated": ["g"]}), SAMPLES)
    journal = Journal(run)
    journal.add_metrics_and_params([Metric("train_loss", 1.5, 1000 + s, s) for s in (1, 2)],
                                   [Param("resolved.fsdp.param_dtype", "float32")])
    journal.add_artifacts("adapter", "adapter")
    journal.add_table(SAMPLES, "eval/samples.json")
    journal.add_status("RUNNING")  # an earlier attempt's end, superseded by the last one
    journal.add_status("FINISHED")
    sent = journal.sync(uri)
    assert sent == {"metrics and params": 3, "artifact folders": 1, "tables": 1, "statuses": 1}
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.params["resolved.fsdp.param_dtype"] == "float32"
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [1, 2]
    assert {a.path for a in client.list_artifacts(run_id, "adapter")} == {"adapter/adapter_config.json"}
    assert not run.exists(JOURNAL) and list((tmp_path / "run").glob(f"{JOURNAL}.synced-*"))
    assert journal.sync(uri) == {}  # nothing left to send


def test_what_an_unreachable_server_did_not_take_stays_in_the_journal(run, capsys, monkeypatch):
    from tests.helpers import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    journal = run["dir"] / JOURNAL
    journal.write_text("\n".join([metric(1), "torn {", json.dumps({"status": "FINISHED"})]) + "\n")
    with pytest.raises(MlflowException):
        Journal(RunDir(str(run["dir"]))).sync(f"http://127.0.0.1:{free_port()}")
    assert sorted(journal.read_text().splitlines()) == sorted([metric(1), "torn {", json.dumps({"status": "FINISHED"})])
    assert not (run["dir"] / "writer.json").exists()  # the claim is released all the same
    assert synced(run, capsys) == {"metrics and params": 1, "lines skipped (not a journal entry)": 1, "statuses": 1}

"""Faults of the run's files and records that once cost what a run reported: a source name MLflow refuses (which
dropped every step's metrics), a journal rewrite cut short by a full disk (which emptied it), a starting adapter
that changed under a resumed run (which silently changed its reference), training data that changed under a
resumed run (which silently moved its passes onto other rows), a tracking server down at the start (a traceback
after Ray had started), an elastic group its placement cannot
hold (which waited forever). A real sqlite MLflow store in tmp_path."""

from __future__ import annotations

import errno
import http.server
import pathlib
import threading

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from app.config.loading import load_config
from app.data.passes import source_key, source_names
from app.data.sources import resolve_source, source_digest
from app.errors import UserInputError
from app.launch.inputs import check_resumed_data, check_tracking_server
from app.runs.layout import JOURNAL, RunDir
from app.tracking.journal import Journal
from app.tracking.logger import RunLogger
from app.tracking.mlflow_run import reopen_run
from tests.helpers import EMBEDDED_CONFIG, free_port


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    return uri, client, client.create_run(experiment).info.run_id


def test_a_source_named_like_a_hive_partition_costs_no_metric(store, tmp_path, capsys):
    """`lang=en` is not a valid metric name: its share gets a valid key, and a batch MLflow refuses still lands
    without the one key it refuses."""
    uri, client, run_id = store
    names = source_names(["/data/lang=en", "/data/c++ (v2), @me"])
    assert [source_key(n) for n in names] == ["lang_en", "c__ _v2__ _me"]
    logger = RunLogger(uri, run_id, retry_seconds=0.1)
    logger.log_metrics({"train_loss": 1.5, "learning_rate": 1e-3, "data_share/lang=en": 0.5}, step=1)
    logger.log_metrics({"train_loss": 1.25, "data_share/lang=en": 0.5}, step=2)
    logger.close()
    assert [m.value for m in client.get_metric_history(run_id, "train_loss")] == [1.5, 1.25]
    assert client.get_metric_history(run_id, "learning_rate")[0].value == 1e-3
    warned = [line for line in capsys.readouterr().err.splitlines() if "data_share/lang=en" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: MLflow refuses 'data_share/lang=en'")


def test_a_journal_rewrite_cut_short_by_a_full_disk_keeps_the_journal(tmp_path, monkeypatch):
    """A sync that sent part of the journal rewrites the rest; a disk that fills meanwhile must leave the
    journal as it was (the sent part is sent again: MLflow keeps one value per step)."""
    run = RunDir(str(tmp_path / "run"))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run.write_record(client.create_run(client.create_experiment("e")).info.run_id)
    journal = Journal(run)
    journal.add_metrics_and_params([Metric("train_loss", 1.0, 1000, 1)], [])
    journal.add_artifacts("no-such-folder", "adapter")  # the sync fails here, after the metric went
    before = (tmp_path / "run" / JOURNAL).read_text()

    def disk_full(self, data, *args, **kwargs):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    monkeypatch.setattr(RunDir, "write_text",
                        lambda self, text, *parts: disk_full(pathlib.Path(self.path(*parts)), text))
    with pytest.raises(OSError):
        journal.sync(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert (tmp_path / "run" / JOURNAL).read_text() == before
    assert not list((tmp_path / "run").glob(f"{JOURNAL}.partial-*"))


def test_a_resume_from_another_starting_adapter_is_refused(store):
    """model.init_adapter (say models:/speller@champion) moved since the run started: resuming would train, and
    under DPO or GRPO measure against, other weights."""
    uri, client, run_id = store
    client.set_tag(run_id, "init_adapter", "models:/speller@champion")
    client.set_tag(run_id, "init_adapter_sha256", "a" * 64)
    same = {"init_adapter": "models:/speller@champion", "init_adapter_sha256": "a" * 64}
    reopen_run(uri, run_id, same, None)  # the same bytes: it continues
    with pytest.raises(UserInputError, match=r"^--resume: the run started from models:/speller@champion "
                                             r"\(sha256 aaaaaaaaaaaa\), and model.init_adapter=models:/speller"
                                             r"@champion gives sha256 bbbbbbbbbbbb"):
        reopen_run(uri, run_id, same | {"init_adapter_sha256": "b" * 64}, None)
    with pytest.raises(UserInputError, match="model.init_adapter is not set"):
        reopen_run(uri, run_id, {"init_adapter_sha256": "none"}, None)


def test_a_resume_on_changed_data_is_refused_and_on_moved_data_is_not(tmp_path):
    """The run record keeps each source's digest: the same bytes at another path resume; other bytes, or
    another number of sources, are refused in one line naming the source."""
    first = tmp_path / "train.jsonl"
    first.write_text('{"text": "one is written one."}\n')
    run = RunDir(str(tmp_path / "run"))
    run.write_record("mlflow-run", [source_digest(resolve_source(str(first)))])
    moved = first.rename(tmp_path / "moved.jsonl")
    digests = lambda *paths: [source_digest(resolve_source(str(p))) for p in paths]
    check_resumed_data(run, [str(moved)], digests(moved))  # the same rows elsewhere: it continues
    moved.write_text('{"text": "two is written two."}\n')
    with pytest.raises(UserInputError, match=rf"^--resume: data.train_path={moved} changed since run run started "
                                             r"\(digest [0-9a-f]{16} then, [0-9a-f]{16} now\)") as error:
        check_resumed_data(run, [str(moved)], digests(moved))
    assert "\n" not in str(error.value)
    with pytest.raises(UserInputError, match="names 2 sources, and run run started with 1"):
        check_resumed_data(run, [str(moved)] * 2, digests(moved, moved))
    RunDir(str(tmp_path / "older")).write_record("mlflow-run")  # a record kept no digests: nothing to check
    check_resumed_data(RunDir(str(tmp_path / "older")), [str(moved)], digests(moved))


def test_a_tracking_server_down_at_the_start_is_one_line_before_anything_starts(tmp_path):
    """The job opens its MLflow run before training: a server that does not answer is named before Ray starts.
    Any answer will do (a proxy asking for credentials), and a local store needs no server."""
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserInputError, match=rf"^mlflow.tracking_uri={uri}: the tracking server does not answer "
                                             r"\(\[Errno 111\] Connection refused\); start it") as error:
        check_tracking_server(uri)
    assert "\n" not in str(error.value)

    class AsksForCredentials(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(401)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AsksForCredentials)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_tracking_server(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    check_tracking_server(f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_an_elastic_group_a_strict_placement_may_not_hold_is_refused_before_launch():
    with pytest.raises(UserInputError, match=r"scaling.placement_strategy=STRICT_SPREAD with scaling.min_workers=1"
                                             r": .* waits for it forever") as error:
        load_config(EMBEDDED_CONFIG, ["scaling.min_workers=1", "scaling.placement_strategy=STRICT_SPREAD"])
    assert "\n" not in str(error.value)
    load_config(EMBEDDED_CONFIG, ["scaling.min_workers=1", "scaling.placement_strategy=SPREAD"])  # it can


def test_replace_text_writes_whole_or_not_at_all(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.write_text("old\n", "f.txt")
    run.replace_text("new\n", "f.txt")
    assert (tmp_path / "run" / "f.txt").read_text() == "new\n"
    assert len(list((tmp_path / "run").iterdir())) == 1  # nothing else is left beside it

"""MLflow's fluent API (the adapter's MLflow Model, models:/ downloads) must not leave its tracking URI behind:
mlflow.set_tracking_uri exports $MLFLOW_TRACKING_URI, and a later job of the same process (a notebook, the
next test) would read it as its own tracking URI and log into the first job's store."""

import os

import mlflow

from app.tracking.mlflow_run import fluent_tracking_uri


def test_the_tracking_uri_is_set_for_the_block_and_put_back(monkeypatch, tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with fluent_tracking_uri(store):
        assert mlflow.get_tracking_uri() == store and os.environ["MLFLOW_TRACKING_URI"] == store
    assert "MLFLOW_TRACKING_URI" not in os.environ

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # the user's own, kept
    try:
        with fluent_tracking_uri(store):
            pass
        assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
        assert mlflow.get_tracking_uri() == "http://127.0.0.1:5000"
    finally:
        mlflow.set_tracking_uri(None)  # MLflow's own global too, for the tests after this one

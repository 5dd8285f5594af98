"""Credentials of the tracking server: never in a config, and moved to MLflow's variables by an explicit call,
not as a side effect of loading a config."""

from __future__ import annotations

import os

import pytest

from app.config.loading import load_config
from app.config.paths import export_tracking_credentials
from app.errors import UserInputError
from tests.helpers import EMBEDDED_CONFIG

PASSWORD = "pw_sentinel_51b7"
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


@pytest.fixture
def no_credentials(monkeypatch):
    for variable in CREDENTIAL_VARIABLES:
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)  # restored after the test, whatever was exported


def test_loading_a_config_leaves_the_environment_alone_and_the_export_is_explicit(no_credentials, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://ray-jobs:{PASSWORD}@mlflow.example:5000")
    cfg = load_config(EMBEDDED_CONFIG)
    assert cfg.mlflow.tracking_uri == "https://mlflow.example:5000" and PASSWORD not in cfg.to_yaml()
    assert not any(variable in os.environ for variable in CREDENTIAL_VARIABLES)
    export_tracking_credentials()
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("ray-jobs", PASSWORD)


def test_credentials_written_into_a_config_are_refused_in_one_line(no_credentials, tmp_path):
    uri = f"https://ray-jobs:{PASSWORD}@mlflow.example:5000"
    config = tmp_path / "with-password.yaml"
    config.write_text(f"mlflow:\n  tracking_uri: {uri}\n")
    for path, overrides in ((config, []), (EMBEDDED_CONFIG, [f"mlflow.tracking_uri={uri}"])):
        with pytest.raises(UserInputError) as e:
            load_config(path, overrides)
        assert "mlflow.tracking_uri holds a user or password" in str(e.value) and "MLFLOW_TRACKING_URI" in str(e.value)
        assert PASSWORD not in str(e.value) and "\n" not in str(e.value)
    assert not any(variable in os.environ for variable in CREDENTIAL_VARIABLES)


def test_an_error_line_quoting_a_url_keeps_neither_its_password_nor_a_presigned_query():
    from app.errors import first_line

    line = first_line(OSError(f"403 Forbidden for https://ray:{PASSWORD}@store:5000/a/adapter_model.safetensors"
                              f"?X-Amz-Signature={PASSWORD}&X-Amz-Security-Token={PASSWORD}\nand more"))
    assert PASSWORD not in line and line == "403 Forbidden for https://store:5000/a/adapter_model.safetensors"
    assert first_line(OSError("is it up? (host?)")) == "is it up? (host?)"  # questions stay

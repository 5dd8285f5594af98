"""The base is checked: adapters served together name one base, and a base whose weights are not the
recorded ones is refused in one line (jobs.serve's loader and the registered pyfunc alike)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from app.serve.models import load
from app.tracking.adapters import Base, check_base
from app.tracking.pyfunc import AdapterModel, weights_digest


def test_a_base_with_other_weights_than_recorded_is_refused(embedded, altered_base):
    recorded = Base(str(embedded["model"]), sha256=weights_digest(embedded["model"]))
    check_base(str(embedded["model"]), recorded, "adapter demo")  # the same bytes pass
    with pytest.raises(ValueError, match=r"^base .*: its weights' sha256 \w+ is not \w+, the base adapter demo"):
        check_base(str(altered_base), recorded, "adapter demo")


def test_the_registered_pyfunc_refuses_another_base(embedded, altered_base, adapters):
    context = SimpleNamespace(artifacts={"adapter": adapters["noisy"]}, model_config={
        "base_model": str(altered_base), "base_model_sha256": weights_digest(embedded["model"])})
    with pytest.raises(ValueError, match="is not .*the base this adapter was trained on"):
        AdapterModel().load_context(context)


def test_adapters_trained_on_different_bases_are_not_served_together(adapters, altered_base, tmp_path):
    moved = Path(shutil.copytree(adapters["other"], tmp_path / "other"))
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(altered_base)}))
    with pytest.raises(ValueError, match=r"^adapters noisy and other were trained on different bases"):
        load({"noisy": adapters["noisy"], "other": str(moved)})
    # a run's recorded revision counts too
    (moved / "finetune_config.yaml").write_text(yaml.safe_dump({"model": {"path": config["base_model_name_or_path"],
                                                                          "revision": "v2"}}))
    with pytest.raises(ValueError, match="different bases"):
        load({"noisy": adapters["noisy"], "other": str(moved)})


def test_the_logged_model_pins_versions_an_index_serves():
    from app.tracking.registry import _pinned_requirements

    pins = _pinned_requirements()
    assert any(p.startswith("torch==") for p in pins) and not any("+" in p for p in pins), pins


@pytest.fixture
def registered(embedded, adapters, tmp_path, monkeypatch) -> str:
    """The noisy adapter logged and registered as the training job does (a local sqlite MLflow)."""
    import mlflow

    from app.runs.layout import ADAPTER, ADAPTER_RUN_CONFIG
    from app.tracking.registry import log_adapter_model
    from tests.helpers import make_config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = make_config(tmp_path, embedded, "train.run_name=r", f"mlflow.tracking_uri={uri}",
                      "mlflow.registered_model=noisy-reg")
    adapter = Path(shutil.copytree(adapters["noisy"], cfg.run_dir.path(ADAPTER)))
    (adapter / ADAPTER_RUN_CONFIG).write_text(cfg.to_yaml())
    mlflow.set_tracking_uri(uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with mlflow.start_run() as run:
        pass
    return f"models:/noisy-reg/{log_adapter_model(cfg, run.info.run_id, {})['version']}"


def test_a_registered_version_loads_only_on_its_recorded_base(registered, embedded, adapters, altered_base):
    from app.tracking.adapters import adapter_folder, base_of

    recorded = base_of(adapter_folder(registered), registered)
    assert recorded.sha256 == weights_digest(embedded["model"])
    model, _ = load({"demo": registered, "noisy": adapters["noisy"]})  # its base, and an adapter of the same one
    assert set(model.peft_config) == {"demo", "noisy"}
    with pytest.raises(ValueError, match=r"^base .*: its weights' sha256 \w+ is not \w+, the base adapter demo"):
        load({"demo": registered}, base=str(altered_base))


def test_serving_adapters_raises_no_deprecation_warning(adapters):
    """PEFT 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` when it loads an adapter: the
    server's own calls must not print it into every replica's log."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load({"noisy": adapters["noisy"], "other": adapters["other"]})
    assert [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))] == []

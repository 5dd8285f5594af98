"""A served name that follows a registry alias: the alias moves while clients keep asking, and every answer is
whole (the version named in its system_fingerprint answers it, as plain PEFT would), none fails, and the
replaced adapter is deleted once its requests have ended. A version trained on another base is refused and
the old one serves on. A real local MLflow registry; the API in-process (Starlette's test client)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import mlflow
import pytest
from fastapi.testclient import TestClient

from app.serve import engine as engine_module
from app.serve.api import Served, build_api, context_length
from app.serve.engine import Engine
from app.serve.follow import AliasFollower
from app.serve.models import load
from app.tracking.adapters import adapter_folder, base_of, pinned
from tests.helpers import register_adapter
from tests.unit.serve.reference import QUESTION, plain_greedy, plain_logprobs

NAME = "speller-reg"


def _register(embedded, adapter: str, folder: Path, uri: str, *overrides: str) -> str:
    return register_adapter(embedded, adapter, folder, uri, NAME, *overrides)


@pytest.fixture
def registry(embedded, adapters, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(engine_module, "RETIRE_AFTER_S", 0.2)
    versions = {name: _register(embedded, adapters[name], tmp_path / name, uri) for name in ("noisy", "other")}
    client = mlflow.tracking.MlflowClient(uri)
    client.set_registered_model_alias(NAME, "champion", versions["noisy"])
    yield client, versions
    mlflow.set_tracking_uri(None)


def _serve(alias: str):
    source = pinned(alias)
    model, tokenizer = load({"speller": source})
    context = context_length(model, tokenizer)
    served = Served(Engine(model, tokenizer, context=context), "base", ["speller"], context, 12,
                    labels={"speller": source})
    served.reload = AliasFollower(served, {"speller": alias}, base_of(adapter_folder(source), source), 0).check
    return served, TestClient(build_api(served, tokenizer), base_url="http://testserver/v1")


def test_requests_through_a_promotion_are_answered_whole_by_one_version_or_the_other(registry, embedded, adapters):
    """Half the clients score a prompt (its log-probabilities tell the version exactly, whatever the batch), half
    generate (greedy text of random adapters can flip on near ties between batch shapes: only the status and
    version are checked there)."""
    client, versions = registry
    served, http = _serve(f"models:/{NAME}@champion")
    ids = served.engine.tokenizer("Write 347 in words.")["input_ids"]
    expected = {f"models:/{NAME}/{versions[name]}": plain_logprobs(embedded["model"], adapters[name], ids)
                for name in ("noisy", "other")}
    assert max(abs(a - b) for a, b in zip(*expected.values())) > 0.1  # the two versions score it apart
    answers, stop = [], threading.Event()

    def ask(scoring: bool):
        while not stop.is_set():
            if scoring:
                response = http.post("/completions", json={"model": "speller", "prompt": ids, "max_tokens": 0,
                                                           "echo": True, "logprobs": 0})
                scored = response.json()["choices"][0]["logprobs"]["token_logprobs"][1:] if response.is_success else 0
            else:
                response = http.post("/chat/completions", json={"model": "speller", "messages": QUESTION,
                                                                "max_tokens": 12})
                scored = None
            answers.append((response.status_code, response.json().get("system_fingerprint"), scored))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(ask, i % 2 == 0) for i in range(4)]
        time.sleep(1.0)
        client.set_registered_model_alias(NAME, "champion", versions["other"])
        reloaded = http.post("/admin/reload").json()
        time.sleep(1.0)
        stop.set()
        for done in clients:
            done.result()
    assert reloaded == {"adapters": {"speller": f"models:/{NAME}/{versions['other']}"}}
    assert all(status == 200 for status, _, _ in answers), answers
    scores = [(version, scored) for _, version, scored in answers if scored is not None]
    assert all(scored == pytest.approx(expected[version], abs=1e-3) for version, scored in scores), scores
    assert {version for version, _ in scores} == set(expected) == {version for _, version, _ in answers}
    assert answers[-1][1] == f"models:/{NAME}/{versions['other']}"
    time.sleep(0.3)
    http.post("/chat/completions", json={"model": "speller", "messages": QUESTION, "max_tokens": 1})  # a loop turn
    assert set(served.engine.model.peft_config) == {served.routes["speller"]}  # the old adapter is gone


def test_a_version_on_another_base_is_refused_and_the_old_one_serves_on(registry, embedded, adapters, tmp_path,
                                                                       altered_base):
    client, versions = registry
    served, http = _serve(f"models:/{NAME}@champion")
    stray = _register(embedded, adapters["other"], tmp_path / "stray", client.tracking_uri,
                      f"model.path={altered_base}")
    client.set_registered_model_alias(NAME, "champion", stray)
    refused = http.post("/admin/reload")
    assert refused.status_code == 502 and "not on the served base" in refused.json()["error"]["message"]
    answer = http.post("/chat/completions", json={"model": "speller", "messages": QUESTION, "max_tokens": 12}).json()
    assert answer["system_fingerprint"] == f"models:/{NAME}/{versions['noisy']}"
    assert answer["choices"][0]["message"]["content"] == plain_greedy(embedded["model"], adapters["noisy"])

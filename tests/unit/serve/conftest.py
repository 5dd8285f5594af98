"""One in-process chat server on the embedded model (base + two random adapters): the real FastAPI app,
engine and PEFT model, driven over HTTP by the OpenAI client through Starlette's test transport."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

KEY = "test-key-0123456789"


@pytest.fixture(scope="session")
def served(adapters):
    from app.serve.api import Served, context_length
    from app.serve.engine import Engine
    from app.serve.models import load

    model, tokenizer = load(adapters)
    context = context_length(model, tokenizer)
    return Served(Engine(model, tokenizer, context=context), "base", list(adapters), context, 12), tokenizer


@pytest.fixture(scope="session")
def http(served):
    from fastapi.testclient import TestClient

    from app.serve.api import build_api, key_digest

    app = build_api(*served, key_digest(KEY), max_body_bytes=16_384)
    with TestClient(app, base_url="http://testserver/v1") as client:
        yield client


@pytest.fixture(scope="session")
def client(http):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


@pytest.fixture
def altered_base(embedded, tmp_path) -> Path:
    """A copy of the embedded base with one weight changed: same files, other bytes."""
    copy = Path(shutil.copytree(embedded["model"], tmp_path / "base"))
    weights = load_file(copy / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy

"""One in-process chat server on the embedded model (base + two random adapters) for each engine (this project's,
and vLLM's where it is installed): the real FastAPI app, engine and PEFT model, driven over HTTP by the OpenAI client
through Starlette's test transport. The API tests run against each."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from app.model.vllm_support import vllm_installed

KEY = "test-key-0123456789"
# vllm-merged: vLLM for the base, an engine per adapter merged in (auto's choice on CPUs)
ENGINES = ["transformers", *(["vllm", "vllm-merged"] if vllm_installed() else [])]


def serving(adapters: dict[str, str], engine: str, max_new_tokens: int = 12, **limits):
    """(Served, tokenizer): the adapters and their base behind `engine`, in fp32 on the CPU."""
    import torch
    from transformers import AutoConfig

    from app.serve.api import Served, context_length, vocabulary_size
    from app.serve.engines import Choice
    from app.serve.models import load_tokenizer, served_files
    from app.serve.server import start_engines

    files = served_files(adapters)
    tokenizer, config = load_tokenizer(files), AutoConfig.from_pretrained(files.base)
    choice = Choice("vllm", engine, "test") if engine == "vllm-merged" else Choice(engine, engine, "test")
    engines = start_engines(choice, files, tokenizer, config, limits.get("max_rows", 16), 0.5,
                            torch.device("cpu"), dtype="float32", eager=True)
    return Served(engines, "base", list(adapters), context_length(config, tokenizer), vocabulary_size(config),
                  max_new_tokens), tokenizer


# On vLLM in make test-all only (`extended`): the schemathesis fuzz (the API layer in front is the one fuzzed over this
# project's engine in make test; vLLM's one-line 400s run in make test in test_hostile_input.py), and the reload
# vLLM refuses at a wider LoRA rank (it starts a vLLM engine of its own)
EXTENDED_ON_VLLM = {"test_no_input_breaks_or_stalls_the_server",
                    "test_a_version_of_a_higher_rank_is_served_here_and_refused_by_vllm_in_one_line"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks
def pytest_collection_modifyitems(items):
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if item.originalname in EXTENDED_ON_VLLM and "vllm" in (params.get("served"), params.get("engine")):
            item.add_marker(pytest.mark.extended)


@pytest.fixture(scope="session", params=ENGINES)
def served(request, adapters):
    served = serving(adapters, request.param)
    yield served
    served[0].engines.close()


@pytest.fixture(scope="session")
def engine_name(served) -> str:
    return served[0].engines.choice.adapters


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


def steps(served) -> int:
    """What the engine behind the base has done so far (its steps, or vLLM's finished requests)."""
    return served[0].engines.base.steps


@pytest.fixture
def altered_base(embedded, tmp_path) -> Path:
    """A copy of the embedded base with one weight changed: same files, other bytes."""
    copy = Path(shutil.copytree(embedded["model"], tmp_path / "base"))
    weights = load_file(copy / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy

"""The chat server's own OpenAPI schema drives schemathesis over every route: bodies generated from the schema
(positive) and mutated out of it (negative), each sent with the API key and without. No answer is a 5xx; one
without the key is a 401; a 4xx is OpenAI's error shape with a one-line message; and no answer takes longer than
a bound that no input can stretch (the body cap and the token limits bound the work: a long stop string or
prompt is refused, not slowly served). The real app, engine and PEFT model, over Starlette's ASGI transport."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from app.serve.api import build_api, key_digest
from tests.unit.serve.conftest import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
BOUND_SECONDS = 20.0  # the slowest answer allowed: 12 tokens of the embedded model take well under a second
CASES: dict[str, Counter] = {}  # answers' statuses per route, printed at the end of the module (-s shows them)


@pytest.fixture(scope="module")
def fuzzed_api(served):
    if served[0].engines.choice.adapters == "vllm-merged":  # the same VllmEngine class as the vllm run's
        pytest.skip("vLLM's engine behind the API is fuzzed on the vllm run")
    gate = build_api(*served, key_digest(KEY), max_body_bytes=16_384)
    schema = schemathesis.openapi.from_asgi("/openapi.json", gate, headers=AUTH)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=400,
                                    deterministic=True)
    yield schema
    print("\nschemathesis cases per route:", {route: (sum(c.values()), dict(c)) for route, c in CASES.items()})


api = schemathesis.pytest.from_fixture("fuzzed_api")


def _timed(case, headers):
    started = time.perf_counter()
    response = case.call(headers=headers)
    return response, time.perf_counter() - started


@pytest.mark.slow  # ~300 requests per route, half of them generating
@api.parametrize()
@settings(suppress_health_check=list(HealthCheck), deadline=None)
def test_no_input_breaks_or_stalls_the_server(case, served):
    names = served[0].names
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):  # most generate: a served model
        choice = len(case.body["model"]) % (len(names) + 1)
        case.body["model"] = names[choice - 1] if choice else case.body["model"]
    keyless, seconds = _timed(case, {})
    assert keyless.status_code == 401, keyless.text
    response, seconds = _timed(case, AUTH)
    assert response.status_code < 500, f"{case.as_curl_command()}\n{response.status_code} {response.text[:500]}"
    CASES.setdefault(case.operation.label, Counter())[response.status_code] += 1
    assert seconds < BOUND_SECONDS, f"{seconds:.1f}s for {case.as_curl_command()[:300]}"
    if response.status_code >= 400:
        error = response.json().get("error") or {}
        assert error.get("message") and "\n" not in error["message"], (response.status_code, response.text[:500])

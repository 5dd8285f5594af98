"""What a client can send that once broke the server: a stop string long enough to stall every request on the
replica, a seed torch cannot take (which failed the whole batch), text JSON allows and UTF-8 does not, roles the
model's own chat template refuses. Each is a 400 naming the field, before any generation; and a greedy request
draws nothing from the generator, whoever else set a seed."""

from __future__ import annotations

import copy

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from app.data.formatting import tokenize_rows
from app.engine.text import held_back
from app.serve.api import Served, build_api, key_digest
from app.serve.protocol import MAX_STOP_CHARS
from tests.unit.serve.conftest import KEY, steps
from tests.unit.serve.reference import QUESTION

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _refused(response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error


def test_a_stop_longer_than_the_cap_is_refused_before_generating(http, served):
    before = steps(served)
    response = http.post("/chat/completions", headers=AUTH, json={
        "model": "base", "messages": QUESTION, "stop": ["x" * (MAX_STOP_CHARS + 1)]})
    _refused(response, "stop")
    assert f"at most {MAX_STOP_CHARS} characters" in response.json()["error"]["message"]
    assert steps(served) == before


def _held_back_by_brute_force(text: str, stops: list[str]) -> int:
    return max((k for stop in stops for k in range(len(stop) - 1, 0, -1) if text.endswith(stop[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab\u00e9c", max_size=12), st.lists(st.text(alphabet="ab\u00e9c", min_size=1, max_size=6),
                                                             min_size=1, max_size=4))
def test_the_held_back_text_is_the_longest_end_that_begins_a_stop(text, stops):
    """The linear matcher keeps exactly what the quadratic one did (the text that may begin a stop)."""
    assert held_back(text, tuple(stops)) == _held_back_by_brute_force(text, stops)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_refused(http, seed):
    _refused(http.post("/chat/completions", headers=AUTH, json={"model": "base", "messages": QUESTION, "seed": seed,
                                                                "temperature": 0.7, "max_tokens": 2}), "seed")


def test_a_greedy_request_with_a_seed_leaves_the_generator_alone(http):
    torch.manual_seed(1234)
    response = http.post("/chat/completions", headers=AUTH, json={"model": "base", "messages": QUESTION,
                                                                  "seed": 99, "max_tokens": 2})
    assert response.status_code == 200 and torch.initial_seed() == 1234


def test_a_lone_surrogate_is_a_400_not_a_500(http):
    body = b'{"model": "base", "messages": [{"role": "user", "content": "x\\ud800y"}]}'
    response = http.post("/chat/completions", headers=AUTH, content=body)
    _refused(response, "messages.0.content")
    assert "lone surrogate at character 1" in response.json()["error"]["message"]


NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_role_the_models_template_refuses_is_a_400(served):
    """Gemma's template refuses a system turn, Mistral's non-alternating turns: the request's fault, said so."""
    tokenizer = copy.deepcopy(served[1])
    tokenizer.chat_template = NO_SYSTEM
    app = build_api(Served(served[0].engines, "base", [], served[0].context, served[0].vocabulary, 4), tokenizer,
                    key_digest(KEY))
    with TestClient(app, base_url="http://testserver/v1") as http:
        response = http.post("/chat/completions", headers=AUTH, json={
            "model": "base", "messages": [{"role": "system", "content": "Be brief."}, *QUESTION]})
    _refused(response, "messages")
    assert "System role not supported" in response.json()["error"]["message"]


def test_a_training_record_the_template_refuses_is_left_out_not_fatal(served):
    tokenizer = copy.deepcopy(served[1])
    tokenizer.chat_template = NO_SYSTEM
    records = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                             {"role": "assistant", "content": "a"}]},
               {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}]
    rows = tokenize_rows(records, tokenizer, "chat", 32)
    assert rows["targets"].tolist()[0] == -1 and rows["targets"][1] > 0  # counted as malformed, the rest trains

"""Text completions and log-probabilities: what lm-evaluation-harness and OpenAI clients send. An echoed
prompt's log-probabilities are plain PEFT's (one forward pass alone), a batch of prompts of different lengths
and adapters scores each as alone, and each generated token's log-probability is that of the token greedy
decoding took."""

from __future__ import annotations

import json

import pytest

from tests.unit.serve.conftest import KEY, steps
from tests.unit.serve.reference import QUESTION, plain_greedy, plain_logprobs

PROMPTS = ["Write 5 in words.", "Spell out the number 912, please, in English words."]


def _post(http, body: dict, route: str = "/completions"):
    return http.post(route, json=body, headers={"Authorization": f"Bearer {KEY}"})


def _ids(served, text: str) -> list[int]:
    return served[1](text)["input_ids"]


def test_an_echoed_prompt_is_scored_as_plain_peft_scores_it(http, served, embedded, adapters):
    ids = _ids(served, PROMPTS[1])
    body = _post(http, {"model": "noisy", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == served[1].decode(ids) and len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(plain_logprobs(embedded["model"], adapters["noisy"], ids),
                                                           abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:]))
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_lm_eval_shaped_batches_of_prompts_and_adapters_score_each_as_alone(http, served, engine_name):
    """What `local-completions` sends for loglikelihood: token ids, echo, one token, one alternative."""
    prompts = [_ids(served, text) for text in PROMPTS]
    request = {"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    before = steps(served)
    together = {model: _post(http, {"model": model, **request}).json()["choices"] for model in ("other", "base")}
    if engine_name == "transformers":  # each request one step: the one token comes from its prompts' forward
        assert steps(served) - before == 2
    for model, choices in together.items():
        for i, prompt in enumerate(prompts):
            alone = _post(http, {"model": model, **request, "prompt": prompt}).json()["choices"][0]
            assert choices[i]["index"] == i and len(choices[i]["logprobs"]["tokens"]) == len(prompt) + 1
            # fp32 rows batched or alone: matmul blocking reorders sums (1.2e-5 seen on AVX-512); a row scored with
            # another's adapter or tokens would be off by 1e-2 and more
            assert choices[i]["logprobs"]["token_logprobs"][1:] == pytest.approx(
                alone["logprobs"]["token_logprobs"][1:], abs=1e-4)
            greedy = choices[i]["logprobs"]  # the one generated token is the most likely
            assert greedy["token_logprobs"][-1] == pytest.approx(max(greedy["top_logprobs"][-1].values()))
    assert together["other"][0]["logprobs"] != together["base"][0]["logprobs"]


def test_generated_tokens_carry_the_logprobs_of_greedy_choices(http, served, embedded, adapters):
    chat = _post(http, {"model": "other", "messages": QUESTION, "max_tokens": 12, "logprobs": True,
                        "top_logprobs": 3}, "/chat/completions").json()["choices"][0]
    assert chat["message"]["content"] == plain_greedy(embedded["model"], adapters["other"])
    content = chat["logprobs"]["content"]
    assert content and all(len(e["top_logprobs"]) == 3 and e["token"] == e["top_logprobs"][0]["token"]
                           and e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"]) for e in content)
    assert "".join(e["token"] for e in content).startswith(chat["message"]["content"])
    text = _post(http, {"model": "other", "prompt": PROMPTS[0], "max_tokens": 6, "logprobs": 0}).json()["choices"][0]
    assert len(text["logprobs"]["token_logprobs"]) >= 1 and text["logprobs"]["top_logprobs"][0] == {}


def test_a_streamed_echo_joins_to_the_whole_answer(http, served):
    request = {"model": "noisy", "prompt": PROMPTS[0], "max_tokens": 6, "echo": True, "logprobs": 1}
    whole = _post(http, request).json()["choices"][0]
    with http.stream("POST", "/completions", json={**request, "stream": True},
                     headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [entry for c in chunks for entry in zip(*(c["logprobs"][k] for k in ("tokens", "token_logprobs")))]
    assert streamed == list(zip(whole["logprobs"]["tokens"], whole["logprobs"]["token_logprobs"]))
    assert chunks[-1]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(("change", "param"), [
    ({"max_tokens": 0}, "max_tokens"),  # nothing generated and nothing echoed
    ({"prompt": [1, 10**6]}, "prompt"),  # not a token of this model
    ({"prompt": [[1, 2], [3, 10**6]]}, "prompt.1"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1]] * 129}, "prompt"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"suffix": "x"}, "suffix"),
    ({"prompt": [1] * 300}, "prompt"),  # over the context
])
def test_a_bad_completion_request_gets_400_naming_the_field(http, served, change, param):
    before = steps(served)
    response = _post(http, {"model": "base", "prompt": PROMPTS[0], **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    assert steps(served) == before

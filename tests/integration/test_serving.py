"""`python -m jobs.serve` on a Ray cluster of its own, queried over HTTP by the OpenAI Python client.

Two adapters on one base: the reference run's, registered in MLflow and served from the registry, and
a second one with random weights read from its folder. Each answer must be what base + that adapter
generate greedily in plain PEFT.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch
from openai import NotFoundError, OpenAI
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import free_port

pytestmark = pytest.mark.e2e
QUESTION = [{"role": "user", "content": "Write 347 in words."}]


def _greedy(base_path, adapter, max_new_tokens=12) -> str:
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                        return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture
def served(reference_run, embedded, tmp_path):
    cfg, summary = reference_run
    torch.manual_seed(3)
    noisy = get_peft_model(AutoModelForCausalLM.from_pretrained(embedded["model"]),
                           LoraConfig(r=8, lora_alpha=64, target_modules="all-linear", init_lora_weights=False))
    noisy.save_pretrained(tmp_path / "noisy")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jobs.serve", "--adapter", f"demo=models:/reference-adapter/{summary['version']}",
         "--adapter", f"noisy={tmp_path / 'noisy'}", "--port", str(port), "--max-new-tokens", "12"],
        env={**os.environ, "MLFLOW_TRACKING_URI": summary["tracking_uri"]}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).ok:
                    break
            except requests.RequestException:  # not listening yet, or the proxy up before the app
                pass
            time.sleep(2)
        else:
            pytest.fail("the Serve application did not come up in 240 s")
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-checked"), summary, tmp_path / "noisy"
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def test_chat_completions_answer_with_the_adapter_the_request_names(served, embedded):
    client, summary, noisy = served
    assert {m.id for m in client.models.list().data} == {"base", "demo", "noisy"}
    answers = {}
    for model in ("demo", "noisy", "base", "demo"):  # switching back and forth between adapters
        reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12)
        assert reply.model == model and reply.choices[0].message.role == "assistant"
        answers.setdefault(model, set()).add(reply.choices[0].message.content)
    assert answers["demo"] == {_greedy(embedded["model"], summary["adapter_path"])}
    assert answers["noisy"] == {_greedy(embedded["model"], noisy)}
    assert answers["base"] == {_greedy(embedded["model"], None)}
    assert len({*answers["demo"], *answers["noisy"], *answers["base"]}) == 3  # three different models
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="missing", messages=QUESTION)

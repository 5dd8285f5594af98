"""What users bring, through the real job (Ray Train, Ray Data, gloo, PEFT, MLflow): architectures other
than Llama, loaded whole or sharded, whose adapters reload in plain PEFT; and the data formats people
have, mixed in set proportions."""

import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from app.launch.driver import run_finetune
from app.model.base import load_tokenizer
from app.train.loss import summed_token_loss, target_token_count
from tests.helpers import NO_DECODING, make_config, tiny_checkpoint, write_jsonl

pytestmark = pytest.mark.e2e
QUICK = ["train.max_steps=8", "train.eval_every=8", "train.checkpoint_every=8", "train.log_every=1",
         "train.learning_rate=1e-2", "train.warmup_steps=0", "train.sample_prompts=0", *NO_DECODING]


def _reloaded_eval_loss(model_path, adapter_path, eval_path, max_seq_len: int) -> float:
    """The adapter in plain PEFT on the plain transformers model, scored on the eval records."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from app.config.sections import ModelSection
    from app.data.formatting import tokenize_rows

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                                      adapter_path).eval()
    records = [json.loads(line) for line in open(eval_path)]
    rows = tokenize_rows(records, load_tokenizer(ModelSection(path=str(model_path))), "auto", max_seq_len)
    batch = {k: torch.as_tensor(v) for k, v in rows.items()}
    with torch.no_grad():
        return (summed_token_loss(model, batch) / target_token_count(batch["labels"])).item()


def _mixture_sources(embedded, tmp_path) -> list[str]:
    """The embedded numbers in three formats people have: an Alpaca JSON array, ShareGPT JSONL, plain text."""
    chats = [json.loads(line)["messages"] for line in embedded["train"].read_text().splitlines()[:600]]
    alpaca = tmp_path / "alpaca_numbers.json"
    alpaca.write_text(json.dumps([{"instruction": m[0]["content"], "input": "", "output": m[1]["content"]}
                                  for m in chats[:200]], indent=1))
    sharegpt = write_jsonl(tmp_path / "sharegpt_numbers.jsonl", [
        {"conversations": [{"from": "human", "value": m[0]["content"]}, {"from": "gpt", "value": m[1]["content"]}]}
        for m in chats[200:400]])
    text = write_jsonl(tmp_path / "text_numbers.jsonl", [{"text": f"{m[0]['content']} {m[1]['content']}."}
                                                         for m in chats[400:600]])
    return [f"data.train_path=[{alpaca}, {sharegpt}, {text}]", "data.mixture_weights=[0.5, 0.3, 0.2]"]


def _check_the_mixture(summary: dict) -> None:
    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    train_inputs = sorted(d.dataset.name for d in run.inputs.dataset_inputs if d.tags[0].value == "train")
    assert train_inputs == ["alpaca_numbers.json", "sharegpt_numbers.jsonl", "text_numbers.jsonl"]
    assert run.data.metrics["data_pass_rows/alpaca_numbers"] == 300  # 600 rows in all, half of them alpaca
    shares = {name: run.data.metrics[f"data_share/{name}"] for name in ("alpaca_numbers", "sharegpt_numbers",
                                                                       "text_numbers")}
    assert shares == pytest.approx({"alpaca_numbers": 0.5, "sharegpt_numbers": 0.3, "text_numbers": 0.2}, abs=0.1)
    assert sum(shares.values()) == pytest.approx(1.0)


# One job per architecture. Each load path runs through the job on two of them (sharded on the tied and
# the renamed head, the cases sharded loading maps specially); that the two paths build the same model,
# bit for bit, is checked for every case in tests/unit/model/test_loading.py without a job. The data
# formats ride along on one job as a weighted mixture of three sources, and QLoRA on another: trained over
# an NF4 base (model.quantization=nf4), its adapter is applied by plain PEFT to the full-precision base.
@pytest.mark.parametrize("architecture, load, data, quantization", [
    pytest.param("qwen2", "sharded", "numbers", "none", marks=pytest.mark.extended),
    pytest.param("gemma3_text", "full", "numbers", "none", marks=pytest.mark.extended),
    pytest.param("phi3", "full", "mixture", "none", marks=pytest.mark.extended),
    ("gpt_neox", "sharded", "numbers", "nf4")])
def test_an_architecture_trains_through_the_job_and_its_adapter_reloads_in_peft(
        architecture, load, data, quantization, ray_cluster, embedded, tmp_path_factory):
    model_path = tiny_checkpoint(architecture, tmp_path_factory.getbasetemp() / f"model-{architecture}",
                                 embedded["model"])
    out = tmp_path_factory.mktemp(f"{architecture}-{load}")
    sources = _mixture_sources(embedded, out) if data == "mixture" else []
    cfg = make_config(out, embedded, *QUICK, f"model.path={model_path}", f"model.load={load}",
                      "model.dtype=float32", f"model.quantization={quantization}", *sources)
    summary = run_finetune(cfg)
    assert summary["steps"] == 8
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.05, summary
    reloaded = _reloaded_eval_loss(model_path, summary["adapter_path"], cfg.data.eval_path, cfg.data.max_seq_len)
    if quantization == "nf4":  # the job evaluated over the 4-bit base; PEFT here applies it to the original
        assert reloaded < summary["initial_eval_loss"] - 0.05
        assert reloaded == pytest.approx(summary["final_eval_loss"], rel=0.05)
    else:
        assert reloaded == pytest.approx(summary["final_eval_loss"], rel=1e-3)
    if data == "mixture":
        _check_the_mixture(summary)

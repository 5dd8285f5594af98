"""The real path on a real pretrained model: SmolLM2-135M-Instruct built from the package that carries it (its GGUF
dequantized once into .cache/models/), two LoRA steps on a reasoning-gym task through the real TorchTrainer, Ray
Data and MLflow, and the exported adapter reloaded in plain PEFT reproduces the run's eval loss. The rest of the
suite keeps the embedded model (fast; every architecture check runs on it)."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.config.loading import load_config
from app.data.formatting import tokenize_rows
from app.data.gym_tasks import write_task_source
from app.launch.driver import run_finetune
from app.train.loss import summed_token_loss, target_token_count
from tests.helpers import FP32, REPO

pytestmark = pytest.mark.e2e

EVAL = "rg://chain_sum?size=8&seed=1000&min_terms=2&max_terms=2&min_digits=1&max_digits=1"


def test_smollm2_trains_on_a_reasoning_gym_task_and_its_adapter_reloads_in_peft(ray_cluster, tmp_path):
    cfg = load_config(REPO / "jobs" / "configs" / "smollm2_sft.yaml", [
        f"train.output_dir={tmp_path}", "train.run_name=smollm2", "train.max_steps=2", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.warmup_steps=0", "train.eval_every=2", "data.max_seq_len=64",
        f"data.eval_path={EVAL}", "eval.generation_rows=8", "eval.max_new_tokens=4", "train.sample_prompts=0",
        *FP32])
    summary = run_finetune(cfg)
    assert summary["steps"] == 2
    assert 0.0 <= summary["initial_eval_answer_match"] <= 1.0 and "final_eval_answer_match" in summary

    adapter = summary["adapter_path"]
    config = json.loads(open(f"{adapter}/adapter_config.json").read())
    base_path = config["base_model_name_or_path"]
    assert base_path.endswith(".cache/models/smollm2-135m-instruct"), base_path
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and all(p.abs().sum() > 0 for p in trained)  # both steps moved every lora_B, whole on reload
    records = [json.loads(line) for line in open(write_task_source(EVAL, "data.eval_path"))]  # the run's eval file
    batch = {k: torch.as_tensor(v) for k, v in tokenize_rows(records, tokenizer, "auto", 64).items()}
    with torch.no_grad():
        loss = summed_token_loss(model, batch) / target_token_count(batch["labels"])
    assert loss.item() == pytest.approx(summary["final_eval_loss"], rel=1e-3)

"""End to end on a real embedded Ray cluster: TorchTrainer, Ray Data, gloo, PEFT and an MLflow store.

Nothing is mocked; these tests train for real on CPU workers.
"""

import json
import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoTokenizer

from app.config.loading import load_config
from app.data.formatting import tokenize_rows
from app.data.packing import first_fit
from app.errors import UserInputError
from app.launch.driver import run_finetune
from tests.helpers import FP32, NO_DECODING, REPO, chat, job_command, make_config, write_jsonl

pytestmark = pytest.mark.e2e

RELOAD_SCRIPT = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from app.data.formatting import tokenize_rows
from app.train.loss import summed_token_loss, target_token_count

base_path, adapter_path, eval_path = sys.argv[1:4]
tokenizer = AutoTokenizer.from_pretrained(adapter_path)
# float32 matches the run's fsdp.param_dtype: the bf16 base weights are computed in fp32
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), adapter_path)
model.eval()
records = [json.loads(line) for line in open(eval_path)]
rows = tokenize_rows(records, tokenizer, "auto", int(sys.argv[4]))
batch = {k: torch.as_tensor(v) for k, v in rows.items()}
with torch.no_grad():
    loss = summed_token_loss(model, batch) / target_token_count(batch["labels"])
print(json.dumps({"eval_loss": loss.item()}))
"""


def test_two_workers_learn_the_task(reference_run):
    cfg, summary = reference_run
    assert summary["steps"] == 30
    assert summary["final_eval_loss"] < 0.5 * summary["initial_eval_loss"]
    assert summary["tokens_per_second"] > 0 and summary["peak_memory_gb"] > 0
    # the first step is reported on its own: the start-up's last stretch, not a later or an average step
    points = summary["startup_seconds"]
    assert points["model_built"] < points["setup_done"] < points["first_step_done"]
    assert summary["first_step_seconds"] == pytest.approx(points["first_step_done"] - points["setup_done"], abs=0.2)
    assert 0 <= summary["first_step_data_wait_seconds"] < summary["first_step_seconds"]


def test_the_mlflow_run_holds_config_curves_and_adapter(reference_run, tmp_path):
    cfg, summary = reference_run
    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "reference"
    assert run.data.params["lora.r"] == str(cfg.lora.r)
    assert run.data.params["scaling.num_workers"] == "2"
    assert run.data.tags["base_model"] == cfg.model.path
    assert run.data.tags["mlflow.source.name"] == "jobs.finetune" and run.data.tags["mlflow.user"]
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in losses) == list(range(1, 31))
    for name in ("learning_rate", "grad_norm", "tokens_per_second", "peak_memory_gb"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 30, name
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [0, 15, 30]
    saves = client.get_metric_history(run.info.run_id, "checkpoint_save_seconds")
    assert [m.step for m in saves] == [6, 12, 18, 24, 30]
    assert "eval_perplexity" in run.data.metrics
    assert "system/cpu_utilization_percentage" in run.data.metrics  # MLflow's sampler, on rank 0's node
    # the demo config scores greedy answers on its held-out numbers at every evaluation
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_exact_match")] == [0, 15, 30]
    assert 0.0 <= summary["final_eval_exact_match"] <= 1.0
    assert run.data.tags["best_metric"] == "eval_exact_match" and int(run.data.tags["best_step"]) in (0, 15, 30)
    assert summary["best"]["step"] == int(run.data.tags["best_step"]) and not summary["stopped_early"]
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/tokenizer.json",
            "adapter/finetune_config.yaml"} <= artifacts
    # train.eval_tasks: lm-eval's score of the trained adapter, on the run and its registered version
    acc = run.data.metrics["lm_eval/embedded_spelling_choice/acc"]
    assert 0.0 <= acc <= 1.0 and "lm_eval/embedded_spelling_choice/acc_stderr" in run.data.metrics
    assert {f.path for f in client.list_artifacts(run.info.run_id, "lm_eval")} == {"lm_eval/results.json"}
    version = client.get_model_version("reference-adapter", summary["version"])
    assert float(version.tags["lm_eval/embedded_spelling_choice/acc"]) == pytest.approx(acc, rel=1e-5)
    # the config's `auto` checkpointing resolved before launch: the value, and why, on the run
    chosen = run.data.tags["plan.model.gradient_checkpointing"].startswith("true")
    assert run.data.params["model.gradient_checkpointing"] == str(chosen)
    resolved = client.download_artifacts(run.info.run_id, "config/resolved.yaml", str(tmp_path))
    trained = cfg.with_set({"model.gradient_checkpointing": chosen, "train.adapters_per_micro_batch": 1,
                            "rollout.workers": 1, "rollout.gpus": 0.0,
                            "rollout.engine": "transformers",
                            "rollout.policy": "merged"})  # decided for any objective
    assert load_config(resolved) == trained  # the logged config reproduces the run's config exactly


def test_the_adapter_reloads_in_a_fresh_process_and_reproduces_the_eval_loss(reference_run, embedded, tmp_path):
    cfg, summary = reference_run
    out = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(embedded["model"]), summary["adapter_path"],
                          str(embedded["eval"]), str(cfg.data.max_seq_len)],
                         capture_output=True, text=True, check=True, cwd=str(tmp_path.parent.parent))
    reloaded = json.loads(out.stdout.strip().splitlines()[-1])["eval_loss"]
    assert reloaded == pytest.approx(summary["final_eval_loss"], rel=1e-3)
    assert reloaded < 0.5 * summary["initial_eval_loss"]


MERGED_LOGITS_SCRIPT = """
import sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

base_path, adapter_path, merged_path = sys.argv[1:4]
base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
ids = torch.randint(0, base.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    peft = PeftModel.from_pretrained(base, adapter_path).eval()(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(merged_path).eval()(input_ids=ids).logits
assert merged.dtype == torch.float32
print((merged - peft).abs().max().item())
"""


def test_the_run_exports_as_a_merged_model_with_the_logits_of_base_plus_adapter(reference_run, embedded, tmp_path):
    cfg, summary = reference_run
    export = [sys.executable, "-m", "jobs.export", "--run", "reference", "--set",
              f"train.output_dir={cfg.train.output_dir}"]
    merged = json.loads(subprocess.run([*export, "--merge", "--dtype", "float32", "--out", str(tmp_path / "merged")],
                                       capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    assert merged["kind"] == "merged" and merged["merged"] > 0
    out = subprocess.run([sys.executable, "-c", MERGED_LOGITS_SCRIPT, str(embedded["model"]),
                          summary["adapter_path"], merged["out"]], capture_output=True, text=True, check=True)
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-4
    adapter = json.loads(subprocess.run([*export, "--out", str(tmp_path / "adapter")], capture_output=True,
                                        text=True, check=True).stdout.splitlines()[-1])
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists() and adapter["kind"] == "adapter"
    again = subprocess.run([*export, "--out", str(tmp_path / "adapter")], capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr


PYFUNC_SCRIPT = """
import json, sys, mlflow, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

model_uri, base_path, adapter_path = sys.argv[1:4]
answers = mlflow.pyfunc.load_model(model_uri).predict(["Write 347 in words.", "Write 12 in words."])
tokenizer = AutoTokenizer.from_pretrained(adapter_path)
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), adapter_path)
ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write 347 in words."}], add_generation_prompt=True,
                                    tokenize=True, return_tensors="pt")["input_ids"]
direct = model.eval().generate(input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print(json.dumps({"answers": answers, "direct": tokenizer.decode(direct[0, ids.shape[1]:], skip_special_tokens=True)}))
"""


def test_the_registered_version_loads_through_pyfunc_and_answers_like_base_plus_adapter(reference_run, embedded,
                                                                                        tmp_path):
    """In a fresh process and working directory, with only the tracking URI and the base model at hand."""
    cfg, summary = reference_run
    assert summary["registered_model"] == "reference-adapter"
    client = MlflowClient(summary["tracking_uri"])
    version = client.get_model_version("reference-adapter", summary["version"])
    assert version.tags["run_id"] == summary["mlflow_run_id"] and version.tags["base_model"] == cfg.model.path
    assert float(version.tags["final_eval_loss"]) == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    assert len(version.tags["base_model_sha256"]) == 64
    out = subprocess.run([sys.executable, "-c", PYFUNC_SCRIPT, "models:/reference-adapter/" + summary["version"],
                          str(embedded["model"]), summary["adapter_path"]], capture_output=True, text=True,
                         check=True, cwd=tmp_path, env={**os.environ, "MLFLOW_TRACKING_URI": summary["tracking_uri"]})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["answers"]) == 2 and result["answers"][0] == result["direct"] != ""


def _loss_curve(summary) -> list[float]:
    history = MlflowClient(summary["tracking_uri"]).get_metric_history(summary["mlflow_run_id"], "train_loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def _one_global_batch(embedded, tmp_path, packing: bool) -> list[str]:
    """Data of exactly one global batch (every step of a 1- and a 2-worker run sees the same rows), and the
    settings that make it one. Packed: the first records that fill an even number of rows, packed in file
    order (data.shuffle=false: every pass packs the same), one row per micro-batch."""
    records = [json.loads(line) for line in embedded["train"].read_text().splitlines()[:40]]
    common = [*NO_DECODING, "train.max_steps=6", "train.eval_every=6", "train.log_every=1", "lora.dropout=0",
              "train.warmup_steps=0", f"data.packing={str(packing).lower()}", *FP32]
    if not packing:
        return [f"data.train_path={write_jsonl(tmp_path / 'batch.jsonl', records[:8])}", "train.global_batch_size=8",
                "train.micro_batch_size=4", *common]
    tokenizer = AutoTokenizer.from_pretrained(embedded["model"])
    lengths = tokenize_rows(records, tokenizer, "auto", 64)["length"]
    count = next(n for n in range(8, 40) if len(first_fit(lengths[:n], 64, 64)) % 2 == 0)
    rows = len(first_fit(lengths[:count], 64, 64))
    return [f"data.train_path={write_jsonl(tmp_path / 'batch.jsonl', records[:count])}", "data.max_seq_len=64",
            "data.shuffle=false", f"train.global_batch_size={rows}", "train.micro_batch_size=1", *common]


@pytest.mark.parametrize("packing", [pytest.param(False, marks=pytest.mark.extended), True],
                         ids=["one-record-per-row", "packed"])
def test_one_and_two_workers_give_the_same_loss_curve(ray_cluster, embedded, tmp_path, packing):
    common = _one_global_batch(embedded, tmp_path, packing)
    one = run_finetune(make_config(tmp_path / "w1", embedded, *common, "scaling.num_workers=1"))
    two = run_finetune(make_config(tmp_path / "w2", embedded, *common, "scaling.num_workers=2"))
    curve_one, curve_two = _loss_curve(one), _loss_curve(two)
    assert len(curve_one) == len(curve_two) == 6
    assert curve_one[-1] < curve_one[0]
    assert curve_two == pytest.approx(curve_one, rel=2e-3)
    assert two["final_eval_loss"] == pytest.approx(one["final_eval_loss"], rel=2e-3)


def test_more_workers_than_the_cluster_holds_fails_before_any_run(ray_cluster, embedded, tmp_path):
    cfg = make_config(tmp_path, embedded, "scaling.num_workers=64", "train.global_batch_size=1024")
    with pytest.raises(UserInputError, match="scaling.num_workers=64 needs 64 CPUs .* but the cluster has"):
        run_finetune(cfg)
    assert not (tmp_path / "outputs" / "mlflow.db").exists()


def test_a_run_whose_plan_exceeds_its_workers_memory_is_refused_before_any_run(ray_cluster, embedded, tmp_path):
    cfg = make_config(tmp_path, embedded, "scaling.device_memory_gb=0.001", "model.gradient_checkpointing=auto")
    with pytest.raises(UserInputError, match=r"^the memory plan needs [0-9.]+ GiB per worker \(the most memory-saving "
                                             r"auto choice: checkpointing on 4 of 4 layers, micro-batch \d+\), more "
                                             r"than the 0.0 GiB usable \(scaling.device_memory_gb=0.001, 90%\)"):
        run_finetune(cfg)
    assert not (tmp_path / "outputs" / "mlflow.db").exists()


@pytest.mark.extended  # the refusals before any run, above, run in CI
def test_data_found_empty_after_the_workers_started_ends_the_job_in_one_line(embedded, tmp_path):
    """The worker group starts while the driver builds the data (a local cluster declares two CPUs more than
    the cores: the data's tasks fit beside both workers): data that leaves nothing to train on still ends
    the job with the driver's one line, no traceback from the ranks that waited for it, and its MLflow run
    FAILED, rather than workers waiting for rows that never come."""
    answers_cut_off = write_jsonl(tmp_path / "long.jsonl", [chat("count " * 60, "seven") for _ in range(8)])
    overrides = [f"data.train_path={answers_cut_off}", "data.max_seq_len=16", "train.run_name=nothing-left"]
    job = subprocess.run(job_command(embedded, tmp_path / "outputs", *overrides), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 2, job.stderr[-3000:]
    assert job.stderr.strip().splitlines()[-1].startswith("error: data.train_path: long has no record left to train on")
    assert "Traceback" not in job.stdout + job.stderr
    cfg = make_config(tmp_path, embedded, *overrides)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])
    assert run.info.status == "FAILED"

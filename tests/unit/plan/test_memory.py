"""The memory planner from the command line: parameter counts from the config alone, options that move
memory the way FSDP does, a fit verdict, and a one-line error for a model it cannot read."""

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from app.launch.memory_budget import check_rollout_actors
from app.model.build import build_lora_model
from app.plan.memory import GiB, plan_memory, with_activations_of
from app.train.sampling import build_sampler
from jobs.plan import main
from tests.helpers import EMBEDDED_CONFIG, REPO, make_config

SHAPE_8B = str(REPO / "benchmarks" / "shapes" / "llama31_8b.json")


def test_parameter_counts_match_the_loaded_model(embedded):
    cfg = load_config(EMBEDDED_CONFIG, [f"model.path={embedded['model']}", "model.gradient_checkpointing=false"])
    model = build_lora_model(cfg.model, cfg.lora, seed=0)
    plan = plan_memory(cfg)
    assert plan.base_params == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert plan.lora_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_options_move_memory_the_way_fsdp_does(embedded):
    def plan(*overrides):
        return plan_memory(load_config(EMBEDDED_CONFIG, [f"model.path={embedded['model']}",  # auto: resolve first
                                                         "model.gradient_checkpointing=false", *overrides]))

    two, one = plan(), plan("scaling.num_workers=1")
    params = "parameters (sharded, stored dtype)"
    assert one.device[params] == pytest.approx(2 * two.device[params])
    assert plan("scaling.mesh=[2,1]").device[params] == pytest.approx(one.device[params])  # HSDP: replicas
    elastic = plan("scaling.min_workers=1")  # may shrink to one worker: planned for it
    assert elastic.workers == 1 and elastic.device[params] == pytest.approx(one.device[params])
    offload = plan("fsdp.cpu_offload=true", "scaling.use_gpu=true")  # offload is from GPUs to host memory
    assert params in offload.host and params not in offload.device
    gathered = "all-gathered parameters (compute dtype)"
    assert plan("fsdp.reshard_after_forward=false").device[gathered] > \
        plan("fsdp.reshard_after_forward=true").device[gathered]
    assert plan("model.gradient_checkpointing=true").device["activations (estimate)"] < \
        plan("model.gradient_checkpointing=false").device["activations (estimate)"]


def test_the_8b_shape_on_8_gpus_fits_80gb_and_on_one_it_does_not(capsys):
    config = str(REPO / "jobs" / "configs" / "llama31_8b.yaml")
    assert main(["--config", config, "--model-config", SHAPE_8B, "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "base 8.030 B params" in out and "fits in 80 GiB" in out
    assert main(["--config", config, "--model-config", SHAPE_8B, "--device-memory-gb", "16",
                 "--set", "scaling.num_workers=1", "--set", "train.global_batch_size=8"]) == 0
    assert "does NOT fit in 16 GiB" in capsys.readouterr().out


def test_an_unreadable_model_is_one_line_exit_2(tmp_path, capsys):
    assert main(["--config", str(EMBEDDED_CONFIG), "--set", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: model.path={tmp_path}: no config.json") and "\n" not in err


@pytest.mark.parametrize("policy", ["merged", "lora"])
def test_a_rollout_actors_plan_counts_what_its_sampler_holds_after_a_step(policy, embedded, tmp_path):
    """GRPO's rollout actor, planned from the config, against the sampler it runs after decoding a step's answers
    (the whole base, its policy merged in or beside, the engine's KV cache): each figure is what it holds."""
    cfg = make_config(tmp_path, embedded, "train.objective=grpo",
                      f"grpo.reward_funcs=[{REPO}/jobs/rewards.py:exact_words]", "rollout.num_generations=4",
                      "rollout.max_completion_tokens=8", "train.global_batch_size=16", "train.micro_batch_size=4",
                      "data.max_seq_len=24", "rollout.workers=1", f"rollout.policy={policy}", "model.dtype=float32",
                      "fsdp.param_dtype=float32", "model.gradient_checkpointing=false")
    plan = plan_memory(cfg)
    actor = plan.rollout_actor
    sampler = build_sampler(cfg)
    prompts = [[5 + i] * 24 for i in range(4)]  # the longest prompts data.max_seq_len admits
    sampler.sample(prompts, cfg.rollout, seed=0)  # 4 answers each: a step of 16
    held = sum(p.numel() * p.element_size() for n, p in sampler.model.named_parameters() if "lora_" not in n)
    assert actor["whole base (stored dtype)"] == held
    cache = sampler.core.cache
    cached = sum(t.numel() * t.element_size() for t in cache.keys + cache.values if t is not None)
    [kv] = [value for name, value in actor.items() if name.startswith("KV cache")]
    assert cached > 0 and kv == cached
    if policy == "merged":
        untouched = sum(w.numel() * w.element_size() for w in sampler.merged.untouched)
        assert plan.rollout_actor_host["merged policy: untouched adapted weights"] == untouched
    else:
        lora = sum(p.numel() * 4 for n, p in sampler.model.named_parameters() if "lora_" in n)
        assert actor["policy: LoRA weights beside the base (fp32)"] == lora


def test_a_gpu_rollout_actor_that_does_not_fit_its_gpu_is_refused_in_one_line(tmp_path):
    """An 8B GRPO run: each actor holds the whole base (16 GB in bf16) and its KV cache; on 16 GiB GPUs it cannot,
    said before any worker or actor starts. On CPUs the actor shares its node's memory: printed, not refused."""
    cfg = load_config(REPO / "jobs" / "configs" / "smollm2_grpo.yaml", [
        "scaling.use_gpu=true", "rollout.workers=2", "rollout.gpus=1", "rollout.policy=lora",
        "model.gradient_checkpointing=false"])
    plan = plan_memory(cfg, SHAPE_8B)
    assert plan.rollout_actor["whole base (stored dtype)"] == pytest.approx(8.03e9 * 2, rel=0.01)
    check_rollout_actors(cfg, plan, 80 * GiB, "a GPU of the cluster")  # fits an 80 GB GPU
    with pytest.raises(UserInputError) as refused:
        check_rollout_actors(cfg, plan, 16 * GiB, "a GPU of the cluster")
    message = str(refused.value)
    assert message.startswith("rollout.workers: each rollout actor plans ") and "\n" not in message
    assert "rollout.batch_rows" in message
    on_cpus = cfg.with_set({"scaling.use_gpu": False, "rollout.gpus": 0})
    check_rollout_actors(on_cpus, plan_memory(on_cpus, SHAPE_8B), 16 * GiB, "host")


def test_distillations_full_vocabulary_loss_grows_with_the_micro_batch_the_plan_chooses(tmp_path):
    """The teacher's logits are per row of a micro-batch: a plan for another micro-batch counts them anew (the
    memory choices try micro-batches from a plan made at one row)."""
    cfg = load_config(REPO / "jobs" / "configs" / "smollm2_distill.yaml", [
        "model.gradient_checkpointing=false", "train.micro_batch_size=1", "distill.teacher_adapter=x"])
    one = plan_memory(cfg)
    sixteen = with_activations_of(one, cfg.with_set({"train.micro_batch_size": 16}))
    loss = "distillation loss (full-vocabulary logits)"
    assert sixteen.device[loss] == pytest.approx(16 * one.device[loss]) and one.device[loss] > 0

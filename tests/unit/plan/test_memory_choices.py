"""`auto` for the choices that trade speed against memory, from the planner's numbers on the meta device (no
training): checkpointing off when the budget allows it, on every layer when only that fits, on the fewest layers
that fit in between; the largest micro-batch that splits the global batch; a refusal naming the plan and the
budget when nothing fits. The selective setting reaches the model: transformers checkpoints every n-th layer."""

from __future__ import annotations

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from app.model.build import build_meta_lora_model
from app.plan.memory import GiB, checkpointed_layers, plan_memory
from app.plan.memory_choices import resolve_memory_choices
from jobs.plan import main
from tests.helpers import EMBEDDED_CONFIG, REPO

CONFIG_8B = str(REPO / "jobs" / "configs" / "llama31_8b.yaml")
SHAPE_8B = str(REPO / "benchmarks" / "shapes" / "llama31_8b.json")


def config_8b(*overrides: str):
    return load_config(CONFIG_8B, ["model.compile=false", *overrides])


def planned_gib(*overrides: str) -> float:
    return plan_memory(config_8b(*overrides), SHAPE_8B).device_total / GiB


def resolve(gib: float, *overrides: str):
    return resolve_memory_choices(config_8b(*overrides), gib * GiB, f"{gib:g} GiB", SHAPE_8B)


def test_checkpointing_is_off_when_the_budget_allows_on_every_layer_when_only_that_fits_and_selective_between():
    micro = "train.micro_batch_size=8"
    off = planned_gib(micro, "model.gradient_checkpointing=false")
    every = planned_gib(micro, "model.gradient_checkpointing=true")
    assert every < off

    roomy = resolve(off / 0.9 + 1, micro)
    assert roomy.cfg.model.gradient_checkpointing is False and not roomy.refusal
    assert "fits without it" in roomy.reasons["model.gradient_checkpointing"]

    tight = resolve(every / 0.9 + 0.01, micro)
    assert tight.cfg.model.gradient_checkpointing is True and tight.cfg.model.checkpoint_every_n_layers == 1

    every_fourth = planned_gib(micro, "model.gradient_checkpointing=true", "model.checkpoint_every_n_layers=4")
    assert every < every_fourth < off
    between = resolve(every_fourth / 0.9 + 0.01, micro)
    model = between.cfg.model
    assert model.gradient_checkpointing is True and not between.refusal
    assert checkpointed_layers(model, 32) == 8  # the fewest that fit: every 5th (7 layers) would not
    assert "8 of 32 layers checkpointed" in between.reasons["model.gradient_checkpointing"]


def test_the_micro_batch_is_the_largest_that_splits_every_group_and_fits():
    roomy = resolve(400, "model.gradient_checkpointing=false")
    assert roomy.cfg.train.micro_batch_size == 8  # 64 sequences over 8 workers
    fixed = resolve(400, "model.gradient_checkpointing=false", "train.global_batch_size=168")
    assert fixed.cfg.train.micro_batch_size == 21
    elastic = resolve(400, "model.gradient_checkpointing=false", "train.global_batch_size=168", "scaling.min_workers=6")
    assert elastic.cfg.train.micro_batch_size == 1  # 168 splits over 8, 7 and 6 workers only one at a time
    smaller = resolve(40, "model.gradient_checkpointing=false")
    assert smaller.cfg.train.micro_batch_size < 8 and not smaller.refusal
    assert smaller.plan.device_total <= 0.9 * 40 * GiB


def test_nothing_that_fits_and_an_explicit_choice_that_does_not_are_refused_in_one_line():
    nothing = resolve(4)
    assert nothing.refusal and "\n" not in nothing.refusal
    with pytest.raises(UserInputError, match=r"needs .* GiB per worker \(the most memory-saving auto choice: "
                                             r"checkpointing on 32 of 32 layers, micro-batch 1\), more than the 3.6"):
        nothing.fitting()
    explicit = resolve(24, "model.gradient_checkpointing=false", "train.micro_batch_size=8", "scaling.mesh=null")
    assert explicit.refusal.startswith("the memory plan needs") and "auto choice" not in explicit.refusal


def test_every_n_layers_reaches_transformers_checkpointing(embedded):
    cfg = load_config(EMBEDDED_CONFIG, [f"model.path={embedded['model']}", "model.gradient_checkpointing=true",
                                        "model.checkpoint_every_n_layers=2"])
    model = build_meta_lora_model(cfg.model, cfg.lora, seed=0)
    flags = [m.gradient_checkpointing for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert flags == [True, False, True, False]


def test_jobs_plan_prints_what_auto_resolves_to(capsys):
    assert main(["--config", CONFIG_8B, "--model-config", SHAPE_8B, "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "plan: model.gradient_checkpointing=false" in out and "plan: train.micro_batch_size=" in out
    assert main(["--config", CONFIG_8B, "--model-config", SHAPE_8B]) == 2  # a GPU config: auto needs its memory
    assert "give --device-memory-gb" in capsys.readouterr().err


def test_the_mesh_is_replicated_where_the_whole_model_fits_else_sharded_over_every_worker():
    fixed = ("model.gradient_checkpointing=false", "train.micro_batch_size=1")
    replicated = planned_gib(*fixed, "scaling.mesh=replicate")
    sharded = planned_gib(*fixed)
    assert sharded + 10 < replicated  # 8B: 16 GB of bf16 weights whole, 2 GB an eighth
    roomy = resolve(replicated / 0.9 + 0.01, *fixed, "scaling.mesh=auto")
    assert roomy.cfg.scaling.mesh == "replicate" and roomy.cfg.shard_group_size == 1
    assert roomy.reasons["scaling.mesh"].startswith("replicate (every worker holds the whole model")
    tight = resolve(replicated / 0.9 - 0.01, *fixed, "scaling.mesh=auto")
    assert tight.cfg.scaling.mesh is None and tight.cfg.shard_group_size == 8 and not tight.refusal
    assert tight.reasons["scaling.mesh"].startswith("null (sharded over every worker: replicated does not fit")
    # less recomputation before less sharding: sharded without checkpointing beats replicated with it
    order = resolve(replicated / 0.9 - 0.01, "train.micro_batch_size=1", "scaling.mesh=auto")
    assert order.cfg.model.gradient_checkpointing is False and order.cfg.scaling.mesh is None
    # an elastic group replicates at any size; one worker has nothing to choose
    elastic = resolve(400, *fixed, "scaling.mesh=auto", "scaling.min_workers=6", "train.global_batch_size=168").cfg
    assert elastic.scaling.mesh == "replicate" and elastic.scaling.mesh_shape(7) == (7, 1)
    alone = resolve(400, *fixed, "scaling.mesh=auto", "scaling.num_workers=1", "train.global_batch_size=8").cfg
    assert alone.scaling.mesh is None and alone.scaling.mesh_shape(1) == (1,)


@pytest.mark.extended  # the planner's other auto choices run in make test (above)
def test_as_many_adapters_share_each_micro_batch_as_fit_beside_it():
    """Each adapter sharing a micro-batch adds a copy of its rows' activations: auto takes the most that fit once
    checkpointing, micro-batch and mesh are chosen, one when only that fits; the plan counts every adapter."""
    adapters = "adapters=[" + ", ".join(f"{{name: a{i}, r: {8 * (1 + i % 2)}}}" for i in range(4)) + "]"
    fixed = ["train.micro_batch_size=4", "model.gradient_checkpointing=true", "scaling.mesh=null", adapters]
    one, four = (planned_gib(*fixed, f"train.adapters_per_micro_batch={k}") for k in (1, 4))
    two = planned_gib(*fixed, "train.adapters_per_micro_batch=2")
    assert one < two < four and planned_gib(*fixed[:3], "train.adapters_per_micro_batch=1") < one  # LoRA x 4
    for budget, shared in ((four / 0.9 + 0.1, 4), (two / 0.9 + 0.01, 2), (one / 0.9 + 0.01, 1)):
        choices = resolve(budget, *fixed)
        assert choices.cfg.train.adapters_per_micro_batch == shared, budget
        assert choices.reasons["train.adapters_per_micro_batch"].startswith(f"{shared} of 4 adapters")
    assert "train.adapters_per_micro_batch" not in resolve(four / 0.9 + 0.1, *fixed[:3]).reasons  # no adapters

"""The run's plan: the config stays what the user wrote, each decided value is decided once and validated with
the config's rules, and the workers read no `auto` the driver decides (a WorkerLaunch refuses a plan with one
left; what the driver's memory decisions hand on has none but what only the workers can measure)."""

import re

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from app.launch.job import WorkerLaunch
from app.launch.memory_budget import memory_saving_decisions
from app.plan.dtypes import dtype_decisions
from app.plan.memory import GiB
from app.plan.memory_choices import resolve_memory_choices
from app.plan.plan import MEASURED_ON_WORKERS, PER_RECORD_MODES, Decision, Plan, autos_left
from app.plan.rollout_sizing import rollout_decisions
from tests.helpers import REPO

AUTOS = ["model.gradient_checkpointing=auto", "train.micro_batch_size=auto", "scaling.mesh=auto", "model.compile=auto",
         "model.dtype=auto", "fsdp.param_dtype=auto", "train.adapters_per_micro_batch=auto"]
WORKERS_MEASURE = MEASURED_ON_WORKERS | PER_RECORD_MODES
SHAPE_8B = str(REPO / "benchmarks" / "shapes" / "llama31_8b.json")


def launch(plan: Plan) -> WorkerLaunch:
    return WorkerLaunch(plan, "run-id", 0.0, passes=None, source_names=("train",))


RESOLVED = {"model.gradient_checkpointing": "false", "train.micro_batch_size": "4", "scaling.mesh": "replicate",
            "train.adapters_per_micro_batch": "1", "rollout.workers": "1", "rollout.gpus": "0",
            "rollout.engine": "transformers", "rollout.policy": "lora"}


@pytest.mark.parametrize("key", list(RESOLVED))
def test_a_launch_with_a_driver_decision_left_auto_is_refused_naming_the_key(key, tmp_path):
    cfg = load_config(None, [f"{k}={'auto' if k == key else v}" for k, v in RESOLVED.items()]
                      + [f"train.output_dir={tmp_path}"])
    assert key in autos_left(cfg)
    with pytest.raises(ValueError, match=rf"^{key}=auto would reach the workers"):
        launch(Plan(cfg))
    named_auto = load_config(None, [f"{k}={v}" for k, v in RESOLVED.items()]
                             + [f"train.output_dir={tmp_path}", "train.run_name=auto"])
    launch(Plan(named_auto))  # a run named "auto" is a name, not a choice left open


def test_what_the_driver_decides_leaves_only_what_the_workers_measure(tmp_path):
    auto = load_config(str(REPO / "jobs" / "configs" / "llama31_8b.yaml"), AUTOS + [f"train.output_dir={tmp_path}"])
    assert set(autos_left(auto)) - WORKERS_MEASURE == {"model.gradient_checkpointing", "train.micro_batch_size",
                                                       "scaling.mesh", "train.adapters_per_micro_batch",
                                                       "rollout.workers", "rollout.gpus",
                                                       "rollout.engine", "rollout.policy"}
    planned = resolve_memory_choices(auto, 400 * GiB, "400 GiB", SHAPE_8B).fitting()
    for decisions in (planned, memory_saving_decisions(auto)):
        plan = Plan(auto).decided(*decisions, *rollout_decisions(auto, cluster_gpus=8.0))
        assert set(autos_left(plan.cfg)) <= WORKERS_MEASURE
        launch(plan)  # accepted
        assert plan.requested is auto and set(autos_left(auto)) - WORKERS_MEASURE  # what was asked is kept
        workers = plan.decided(*dtype_decisions(plan.cfg, fast_bf16=True), Decision("model.compile", False))
        assert set(autos_left(workers.cfg)) <= PER_RECORD_MODES, "the workers' step would read auto"


def test_a_plan_decides_each_value_once_and_keeps_the_configs_rules(tmp_path):
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "train.micro_batch_size=auto",
                             "train.global_batch_size=8", "scaling.num_workers=2"])
    plan = Plan(cfg).decided(Decision("train.micro_batch_size", 2, "2 (fits)"))
    assert (plan.cfg.train.micro_batch_size, cfg.train.micro_batch_size) == (2, "auto")
    assert plan.reasons == {"train.micro_batch_size": "2 (fits)"} and plan.grad_accum_steps == 2
    with pytest.raises(RuntimeError, match="train.micro_batch_size was decided twice"):
        plan.decided(Decision("train.micro_batch_size", 1))
    with pytest.raises(RuntimeError, match="break a rule of the config"):  # 8 rows do not split into 3 x 2
        Plan(cfg).decided(Decision("train.micro_batch_size", 3))


def test_accumulation_steps_of_an_undecided_micro_batch_is_a_one_line_error(tmp_path):
    auto = Plan(load_config(None, [f"train.output_dir={tmp_path}", "train.micro_batch_size=auto"]))
    with pytest.raises(UserInputError, match=r"^train.micro_batch_size=auto: .*jobs.plan"):
        auto.grad_accum_steps  # noqa: B018 (the property is what is tested)


@pytest.mark.parametrize("fast_bf16, dtype", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtypes_follow_the_hardware_and_an_explicit_one_is_kept(fast_bf16, dtype, tmp_path):
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "model.dtype=auto", "fsdp.param_dtype=auto"])
    plan = Plan(cfg).decided(*dtype_decisions(cfg, fast_bf16))
    assert (plan.cfg.model.dtype, plan.cfg.fsdp.param_dtype) == (dtype, dtype)
    assert plan.reasons["fsdp.param_dtype"].startswith(dtype)
    explicit = load_config(None, [f"train.output_dir={tmp_path}", "model.dtype=float32", "fsdp.param_dtype=auto"])
    assert [d.key for d in dtype_decisions(explicit, fast_bf16)] == ["fsdp.param_dtype"]


def test_no_code_rewrites_a_config_in_place_of_deciding():
    """A derived config is made by FinetuneConfig.with_set (validated again) or by a plan's decisions, never by
    pydantic's model_copy, which checks no rule; the pattern itself is checked to catch the old form."""
    pattern = re.compile(r"\.model_copy\(")
    assert pattern.search('cfg.model_copy(update={"model": cfg.model.model_copy(update={"load": "full"})})')
    files = [p for folder in ("app", "jobs", "benchmarks") for p in (REPO / folder).rglob("*.py")]
    found = [f"{p.relative_to(REPO)}:{n}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []

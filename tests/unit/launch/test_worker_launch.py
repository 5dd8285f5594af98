"""The workers read no `auto` the driver decides: a WorkerLaunch refuses a config with one left, and what the
driver's resolution hands on (the memory plan's choices, or the memory-saving ones without a plan) has none but
what only the workers can measure."""

import pytest

from app.config.loading import load_config
from app.launch.job import MEASURED_ON_WORKERS, PER_RECORD_MODES, WorkerLaunch, autos_left
from app.launch.memory_budget import memory_saving_choices
from app.model.memory_choices import resolve_memory_choices
from app.model.memory_plan import GiB
from tests.helpers import REPO

AUTOS = ["model.gradient_checkpointing=auto", "train.micro_batch_size=auto", "scaling.mesh=auto", "model.compile=auto",
         "model.dtype=auto", "fsdp.param_dtype=auto"]
WORKERS_MEASURE = MEASURED_ON_WORKERS | PER_RECORD_MODES


def launch(cfg) -> WorkerLaunch:
    return WorkerLaunch(cfg, "run-id", 0.0, passes=None, source_names=("train",))


RESOLVED = {"model.gradient_checkpointing": "false", "train.micro_batch_size": "4", "scaling.mesh": "replicate"}


@pytest.mark.parametrize("key", list(RESOLVED))
def test_a_launch_with_a_driver_decision_left_auto_is_refused_naming_the_key(key, tmp_path):
    cfg = load_config(None, [f"{k}={'auto' if k == key else v}" for k, v in RESOLVED.items()]
                      + [f"train.output_dir={tmp_path}"])
    assert key in autos_left(cfg)
    with pytest.raises(ValueError, match=rf"^{key}=auto would reach the workers"):
        launch(cfg)
    named_auto = load_config(None, [f"{k}={v}" for k, v in RESOLVED.items()]
                             + [f"train.output_dir={tmp_path}", "train.run_name=auto"])
    launch(named_auto)  # a run named "auto" is a name, not a choice left open


def test_what_the_driver_resolves_leaves_only_what_the_workers_measure(tmp_path):
    auto = load_config(str(REPO / "jobs" / "configs" / "llama31_8b.yaml"), AUTOS + [f"train.output_dir={tmp_path}"])
    assert set(autos_left(auto)) - WORKERS_MEASURE == {"model.gradient_checkpointing", "train.micro_batch_size",
                                                       "scaling.mesh"}
    shape = str(REPO / "benchmarks" / "shapes" / "llama31_8b.json")
    planned = resolve_memory_choices(auto, 400 * GiB, "400 GiB", shape)
    saving, _ = memory_saving_choices(auto)
    for cfg in (planned.cfg, saving):
        assert set(autos_left(cfg)) <= WORKERS_MEASURE
        launch(cfg)  # accepted

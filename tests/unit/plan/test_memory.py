"""The memory planner from the command line: parameter counts from the config alone, options that move
memory the way FSDP does, a fit verdict, and a one-line error for a model it cannot read."""

import pytest

from app.config.loading import load_config
from app.model.build import build_lora_model
from app.plan.memory import plan_memory
from jobs.plan import main
from tests.helpers import EMBEDDED_CONFIG, REPO

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

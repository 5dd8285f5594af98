"""`model.compile: auto`: measured once per hardware and shape, then remembered; refused cases decided without
measuring; inductor pointed at the shared cache directory."""

from __future__ import annotations

import json
import os

import pytest
import torch

from app.config.loading import load_config
from app.plan import compile_choice
from app.plan.compile_choice import CHOICES_FILE, compile_cache_dir, decide_compile, use_compile_cache
from tests.helpers import EMBEDDED_CONFIG

CPU = torch.device("cpu")


def config(embedded, *overrides: str):
    """Checkpointed: packed rows on a CPU without checkpointing are decided without measuring (below)."""
    return load_config(EMBEDDED_CONFIG, [f"model.path={embedded['model']}", "model.compile=auto",
                                         "model.gradient_checkpointing=true", *overrides])


def test_a_measurement_is_remembered_and_decides_the_next_run(embedded, tmp_path, monkeypatch):
    """The timer is replaced by fixed step times (real ones are noise on a shared machine); the real measurement
    is what docs/performance.md quotes."""
    times = iter([(0.020, 0.010), (0.010, 0.0099)])  # a first shape gains 2x, a second 1.01x
    monkeypatch.setattr(compile_choice, "measure_layer_step", lambda cfg, device: next(times))
    decided, why = decide_compile(config(embedded), CPU, tmp_path)
    assert decided and "(2.00x); measured" in why
    again, why = decide_compile(config(embedded), CPU, tmp_path)  # the same shape: not measured again
    assert again and "remembered" in why
    longer, why = decide_compile(config(embedded, "data.max_seq_len=64"), CPU, tmp_path)
    assert not longer and "(1.01x); measured" in why  # below the 1.10x that pays for compiling
    assert len(json.loads((tmp_path / CHOICES_FILE).read_text())) == 2


def test_nf4_and_packed_rows_on_a_cpu_without_checkpointing_are_not_compiled_and_not_measured(embedded, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setattr(compile_choice, "measure_layer_step", lambda cfg, device: pytest.fail("measured"))
    decided, why = decide_compile(config(embedded, "model.quantization=nf4"), CPU, tmp_path)
    assert not decided and "NF4" in why
    decided, why = decide_compile(config(embedded, "model.gradient_checkpointing=false"), CPU, tmp_path)
    assert not decided and "per-record attention" in why


def test_the_cache_is_the_storages_else_the_runs_directorys(tmp_path, monkeypatch):
    assert str(compile_cache_dir(str(tmp_path / "runs"), "/shared")) == "/shared/.cache/torch-compile"
    assert compile_cache_dir(str(tmp_path / "runs"), None) == tmp_path / "runs" / ".cache" / "torch-compile"
    assert "ray-lora-fsdp" in str(compile_cache_dir("s3://bucket/runs", None))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_compile_cache(tmp_path / "cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()

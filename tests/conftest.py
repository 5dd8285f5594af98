"""Shared fixtures: the embedded model and data (built once), one Ray session, config helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.config import FinetuneConfig, load_config

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_CONFIG = REPO / "jobs" / "configs" / "embedded.yaml"


@pytest.fixture(scope="session")
def embedded() -> dict[str, Path]:
    """The embedded model and data, built by the same code as `make embedded` (reused if present)."""
    root = REPO / ".cache" / "embedded"
    if not (root / "model" / "config.json").exists():
        from app.embedded import build_embedded

        build_embedded(root)
    return {"model": root / "model", "train": root / "data" / "train.jsonl", "eval": root / "data" / "eval.jsonl"}


@pytest.fixture(scope="session")
def ray_cluster():
    """One embedded Ray cluster for every test that trains (starting one costs seconds)."""
    import ray

    # Ray Train's controller records a reported checkpoint at its next poll (2 s by default); polling
    # faster keeps the fault tests' kill-to-checkpoint margins short. Set before Ray starts its processes.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"
    ray.init(num_cpus=(os.cpu_count() or 1) + 2, include_dashboard=False)
    yield ray
    ray.shutdown()


# Settings of the short runs the e2e and fault tests compare: every step logged, no shuffle buffer.
SHORT_RUN = ["train.max_steps=30", "train.checkpoint_every=6", "train.eval_every=15", "train.log_every=1",
             "train.warmup_steps=2", "data.shuffle_buffer_rows=0"]


@pytest.fixture(scope="session")
def reference_run(ray_cluster, embedded, tmp_path_factory):
    """One uninterrupted 2-worker run of SHORT_RUN: checked by the e2e tests, compared against by the
    fault tests."""
    from app.launcher import run_finetune

    cfg = make_config(tmp_path_factory.mktemp("reference"), embedded, *SHORT_RUN, "train.run_name=reference")
    return cfg, run_finetune(cfg)


def make_config(tmp_path: Path, embedded: dict[str, Path], *overrides: str) -> FinetuneConfig:
    """The embedded config, reading the built model and data, writing under tmp_path, with overrides."""
    return load_config(EMBEDDED_CONFIG, [
        f"model.path={embedded['model']}", f"data.train_path={embedded['train']}",
        f"data.eval_path={embedded['eval']}", f"train.output_dir={tmp_path / 'outputs'}", *overrides])


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}

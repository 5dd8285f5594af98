"""Shared fixtures: the embedded model and data (built once), one Ray session, the reference run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import REPO, SHORT_RUN, make_config


@pytest.fixture(scope="session")
def embedded() -> dict[str, Path]:
    """The embedded model and data, built by the same code as `make embedded` (reused if present)."""
    root = REPO / ".cache" / "embedded"
    if not (root / "model" / "config.json").exists():
        from app.model.embedded import build_embedded

        build_embedded(root)
    return {"model": root / "model", "train": root / "data" / "train.jsonl", "eval": root / "data" / "eval.jsonl"}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that trains (starting one costs seconds)."""
    import ray

    # Ray Train's controller records a reported checkpoint at its next poll (2 s by default); polling
    # faster keeps the fault tests' kill-to-checkpoint margins short. Set before Ray starts its processes.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"
    ray.init(num_cpus=(os.cpu_count() or 1) + 2, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def reference_run(ray_cluster, embedded, tmp_path_factory):
    """One uninterrupted 2-worker run of SHORT_RUN: checked by the e2e tests, compared against by the
    fault tests."""
    from app.launch.driver import run_finetune

    cfg = make_config(tmp_path_factory.mktemp("reference"), embedded, *SHORT_RUN, "train.run_name=reference",
                      "eval.generation_rows=100", "train.best_metric=eval_exact_match",
                      "mlflow.registered_model=reference-adapter")
    return cfg, run_finetune(cfg)

"""Shared fixtures: the embedded model and data (built once), one Ray session, the reference run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import REPO, SHORT_RUN, make_config


@pytest.fixture(scope="session")
def embedded() -> dict[str, Path]:
    """The embedded model and data, built by the same code as `make embedded` (once, also when several
    test processes start at the same time; reused if present)."""
    from app.model.embedded import build_once

    root = REPO / ".cache" / "embedded"
    build_once(root)
    return {"model": root / "model", "train": root / "data" / "train.jsonl", "eval": root / "data" / "eval.jsonl"}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that trains (starting one costs seconds)."""
    import ray

    # Ray Train's controller records a reported checkpoint at its next poll (2 s by default); polling
    # faster keeps the fault tests' kill-to-checkpoint margins short. Set before Ray starts its processes.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"
    # Two test processes may each run a cluster (make test: pytest -n 2): a bounded object store each.
    from app.launch.driver import state_api_address_pinned

    # as a local job does: Ray Train's state API queries find this cluster (its dashboard costs a few seconds)
    with state_api_address_pinned() as port:
        ray.init(num_cpus=(os.cpu_count() or 1) + 2, dashboard_port=port, object_store_memory=2 * 2**30)
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


# `make test` runs the suite in two processes (pytest-xdist, --dist loadgroup): a test module stays in one
# process, so its module-scoped servers and clusters start once; the modules that compare against the
# session's reference run share its process, so it is trained once.
SHARED_GROUPS = {"test_e2e": "reference_run", "test_fault_tolerance": "reference_run"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which writes the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(module, item.module.__name__)))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Stops a `--dist loadgroup` run whose groups did not reach xdist's test ids (pytest 9 ignores what
    xdist 3.8 writes): each module would start its clusters and servers in both processes."""
    if session.config.getvalue("loadgroup") and session.items and "@" not in session.items[0].nodeid:
        raise pytest.UsageError("pytest-xdist's loadgroup ids did not apply (pytest 9?): install pytest<9")

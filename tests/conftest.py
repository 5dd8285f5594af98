"""Shared fixtures: the embedded model and data (built once), one Ray session, the reference run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.logs import quiet_import_noise
from tests.helpers import REPO, SHORT_RUN, make_config

quiet_import_noise()  # the test process starts here

# Ray Train's controller records a reported checkpoint at its next poll (2 s by default); polling faster
# keeps the fault tests' kill-to-checkpoint margins short and every job's start and end shorter. Set at
# import, before any test starts a Ray cluster (the session one, the local stack, a job's own).
os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"


@pytest.fixture(scope="session")
def embedded() -> dict[str, Path]:
    """The embedded model and data, built by the same code as `make embedded` (once, also when several
    test processes start at the same time; reused if present)."""
    from jobs.embedded import build_once

    root = REPO / ".cache" / "embedded"
    build_once(root)
    return {"model": root / "model", "train": root / "data" / "train.jsonl", "eval": root / "data" / "eval.jsonl"}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that trains (starting one costs seconds)."""
    import ray

    # Two test processes may each run a cluster (make test: pytest -n 2): a bounded object store each.
    from app.launch.cluster import state_api_address_pinned

    # as a local job does: Ray Train's state API queries find this cluster (its dashboard costs a few seconds)
    with state_api_address_pinned() as port:
        ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 2, dashboard_port=port,
                 object_store_memory=2 * 2**30)  # "local": never a cluster another test started (test_multinode)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def reference_run(ray_cluster, embedded, tmp_path_factory):
    """One uninterrupted 2-worker run of SHORT_RUN: checked by the e2e tests, compared against by the
    fault tests."""
    from app.launch.driver import run_finetune

    cfg = make_config(tmp_path_factory.mktemp("reference"), embedded, *SHORT_RUN, "train.run_name=reference",
                      "eval.generation_rows=16", "train.best_metric=eval_exact_match",
                      "mlflow.registered_model=reference-adapter", "train.eval_tasks=[embedded_spelling_choice]",
                      "mlflow.system_metrics_seconds=1")  # MLflow's sampler logs once an interval has passed
    return cfg, run_finetune(cfg)


# `make test` runs the suite in two processes (pytest-xdist, --dist loadgroup): a test module stays in one
# process, so its module-scoped servers and clusters start once; the modules that use the session's
# reference run share its process, so it is trained once.
# The unit modules that query the session's chat server of each engine (tests/unit/serve/conftest.py `served`) share
# a process too: each engine then starts once (a vLLM base with merged adapters takes over a minute), not per module.
SERVED = "tests.unit.serve.served"
SHARED_GROUPS = {**{f"tests.integration.{name}": "reference_run"
                    for name in ("test_e2e", "test_fault_tolerance", "test_serving")},
                 **{f"tests.unit.serve.{name}": SERVED
                    for name in ("test_api", "test_api_fuzz", "test_completions", "test_engine", "test_hostile_input")}}
# The longest groups of `make test`, longest first (measured: a fresh clone's `--durations`; the `extended` ones,
# which only `make test-all` runs, beside those they stand in for): handed out first, so the two processes start on
# the two longest and the short modules fill in behind them (`make test` passes --no-loadscope-reorder: xdist keeps
# this order instead of sorting groups by their number of tests).
LONGEST_FIRST = ["reference_run", "tests.integration.test_grpo", "tests.integration.test_jobs", SERVED,
                 "tests.integration.test_tune", "tests.integration.test_multinode",
                 "tests.unit.train.test_side_by_side", "tests.integration.test_side_by_side",
                 "tests.unit.serve.test_follow", "tests.integration.test_rollout_group",
                 "tests.integration.test_run_safety", "tests.integration.test_data_pipeline",
                 "tests.integration.test_real_model", "tests.integration.test_models_and_formats",
                 "tests.integration.test_preference", "tests.integration.test_distill",
                 "tests.integration.test_lost_claim", "tests.unit.model.test_sharding",
                 "tests.unit.plan.test_memory_choices", "tests.unit.benchmarks.test_gpu_check",
                 "tests.unit.train.test_host_memory", "tests.unit.train.test_recipe",
                 "tests.integration.test_vllm_rollouts", "tests.integration.test_tracking",
                 "tests.unit.train.test_distill", "tests.unit.train.test_grpo_recipe",
                 "tests.unit.model.test_loading", "tests.unit.train.test_generation"]
# Many short independent tests with no module fixture: left ungrouped and last, they even out the end.
FILLERS = {"tests.unit.model.test_packing_probe"}
# Modules of long tests that share no module fixture: a group per test, so the two processes share them out
# instead of one running them all in a row.
SPLIT = {"tests.integration.test_tune", "tests.integration.test_side_by_side"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which writes the groups into the test ids
def pytest_collection_modifyitems(config, items):
    def group(item) -> str:
        module = item.module.__name__
        return f"{module}.{item.name}" if module in SPLIT else SHARED_GROUPS.get(module, module)

    def rank(item) -> int:
        if item.module.__name__ in FILLERS:
            return len(LONGEST_FIRST) + 1
        module = group(item).rsplit(".", 1)[0] if item.module.__name__ in SPLIT else group(item)
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order
    for item in items:
        if item.module.__name__ not in FILLERS:
            item.add_marker(pytest.mark.xdist_group(group(item)))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Stops a `--dist loadgroup` run whose groups did not reach xdist's test ids (pytest 9 ignores what
    xdist 3.8 writes): each module would start its clusters and servers in both processes."""
    grouped = [item for item in session.items if item.module.__name__ not in FILLERS]
    if getattr(session.config.option, "loadgroup", False) and grouped and "@" not in grouped[0].nodeid:
        raise pytest.UsageError("pytest-xdist's loadgroup ids did not apply (pytest 9?): install pytest<9")

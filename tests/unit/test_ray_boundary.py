"""Ray stays at the edges: only the driver, the worker entry, the Ray Data side of the data pipeline and
the Serve app import it. Everything else (the recipe, the model, the plain data modules, runs, tracking)
is plain torch / transformers / PEFT / MLflow code that a unit test drives without a cluster."""

import pkgutil
import subprocess
import sys

import app

RAY_MODULES = {
    "app.launch.driver",  # ray.shutdown of a cluster it started
    "app.launch.cluster",  # ray.init, the cluster's resources
    "app.launch.memory_budget",  # the nodes' memory, a one-GPU probe task
    "app.launch.data_build",  # Ray Data, the pass coordinator actor
    "app.launch.trainer",  # the TorchTrainer
    "app.launch.rollout_group",  # GRPO's rollout actors and reward tasks
    "app.launch.tune_sweep",  # Ray Tune: a sweep's trials, schedulers and books
    "app.launch.adapter_sweep",  # Ray Tune's variant generator: a sweep's trials as one job's adapters
    "app.launch.rank",  # Ray Train's context, checkpoints and preemption notices inside a worker
    "app.launch.eval_tasks",  # an lm-eval run as a one-GPU task
    "app.launch.recording",  # the Ray job id, for the MLflow run's tags
    "app.launch.console",  # quiets Ray's own loggers
    "app.data.pipeline",  # Ray Data: read, tokenize
    "app.data.coordinator",  # the pass coordinator actor
    "app.data.packing",  # writes Ray Data's tensor columns
    "app.serve.server",  # Ray Serve
}


def all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(app.__path__, "app.") if not m.ispkg)


def test_the_allowlist_names_modules_that_exist():
    assert RAY_MODULES <= set(all_modules())


def test_no_module_outside_the_edges_imports_ray():
    plain = [m for m in all_modules() if m not in RAY_MODULES]
    assert {"app.train.recipe", "app.model.build", "app.data.formatting"} <= set(plain)
    probe = ("import importlib, sys\n"
             f"for name in {plain!r}:\n"
             "    importlib.import_module(name)\n"
             "    if 'ray' in sys.modules:\n"
             "        print(name); break\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "", f"{result.stdout.strip()} imports ray"


def test_the_driver_leaves_the_training_stack_to_the_workers_and_the_rest_until_ray_starts():
    """The driver names the training function without importing what it runs (PEFT, the recipe, distributed
    checkpointing): seconds of every job's start that only the worker processes need. What it does use (torch
    and transformers for the checks, Ray Train, Ray Data, MLflow) loads once Ray is starting: importing the
    driver takes Ray and the config alone."""
    training_stack = ("peft", "app.train.recipe", "torch.distributed.checkpoint", "torch", "transformers",
                      "ray.train", "ray.data", "mlflow", "pandas")
    probe = f"import sys, app.launch.driver\nprint(sorted(m for m in {training_stack!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"

"""Where an evaluation runs: as a one-GPU Ray task on a cluster that has GPUs (bf16 on the GPU), in this
process otherwise (fp32 on the CPU). lm-eval's Hugging Face backend scores one model on one device.

The task finds the adapter itself (a registered version is downloaded on the GPU node, from the tracking
server this process uses); a folder or run must be on storage that node reads, as a training job's are.
"""

from __future__ import annotations

import dataclasses
import os

import ray

from app.environment import joins_a_cluster
from app.eval_tasks.harness import Evaluation, run_harness
from app.tracking.adapters import adapter_folder


def gpus_in_the_cluster() -> float:
    if not joins_a_cluster():
        return 0.0
    if not ray.is_initialized():
        ray.init(log_to_driver=False)
    return ray.cluster_resources().get("GPU", 0.0)


def _harness_on(base: str, source: str | None, output_dir: str, evaluation: Evaluation, tracking: dict) -> dict:
    """In the task: MLflow's URI and credentials (passed with the function, never in a runtime environment that
    the dashboard shows), the adapter, the harness."""
    os.environ.update(tracking)
    adapter = None if source is None else str(adapter_folder(source, output_dir))
    return run_harness(base, adapter, evaluation)


def evaluate_where_it_fits(base: str, source: str | None, output_dir: str, evaluation: Evaluation) -> tuple[dict, str]:
    """lm-eval's results for `base` with the adapter `source` names (None: the base alone), and where they were
    computed."""
    if gpus_in_the_cluster() >= 1:
        on_gpu = dataclasses.replace(evaluation, device="cuda", dtype="bfloat16")
        tracking = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
        task = ray.remote(num_gpus=1)(_harness_on)
        return ray.get(task.remote(base, source, output_dir, on_gpu, tracking)), "a GPU node (Ray task, bf16)"
    return _harness_on(base, source, output_dir, evaluation, {}), "this process (CPU, fp32)"

"""Ray Train's side of a run: the TorchTrainer that starts one worker per GPU (or CPU slot) with the run's
retries, checkpoint bookkeeping and storage, and its fit."""

from __future__ import annotations

import functools
import os
from concurrent.futures import Future

import ray
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchConfig, TorchTrainer

from app.data.passes import source_names
from app.launch import console, worker_hooks
from app.launch.background import raise_failure
from app.launch.job import Job
from app.launch.worker import WorkerLaunch, train_worker
from app.model.sharding import process_group_backend
from app.train import host_memory


def build_trainer(job: Job, passes: dict, rollouts: list = ()) -> TorchTrainer:
    """The worker group of the run: each worker runs app/launch/worker.py's `train_worker` with a WorkerLaunch
    (the run's plan, the MLflow run, the pass coordinators by data (app/launch/data_build.py), the starting
    adapter's weights through the object store, GRPO's rollout actors, and the MLflow credentials, which travel
    with the function, never in an environment)."""
    cfg, inputs = job.cfg, job.inputs
    credentials = {k: os.environ[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
                   if k in os.environ}
    launch = WorkerLaunch(job.plan, job.run_id, job.startup.job_start_time, passes[""],
                          source_names([s.location for s in inputs.train]), credentials,
                          ray.put(inputs.init_adapter) if inputs.init_adapter is not None else None,
                          ray.put(inputs.teacher) if inputs.teacher is not None else None, tuple(rollouts),
                          job.trial, {name: coordinator for name, coordinator in passes.items() if name})
    resources = {"CPU": cfg.scaling.cpus_per_worker} | ({"GPU": 1} if cfg.scaling.use_gpu else {})
    return TorchTrainer(
        functools.partial(train_worker, launch),
        scaling_config=ScalingConfig(
            num_workers=(cfg.scaling.min_workers, cfg.scaling.num_workers) if cfg.scaling.elastic
            else cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu, resources_per_worker=resources,
            placement_strategy=cfg.scaling.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_seconds),
        run_config=RunConfig(  # the same name + storage path is what lets a relaunch resume
            name=job.trial.train_run_name if job.trial else cfg.train.run_name, storage_path=cfg.train.output_dir,
            callbacks=[TrialReports(job.trial.reports)] if job.trial else None,
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            worker_runtime_env={"env_vars": console.worker_env(job.verbose) | worker_hooks.forwarded() |
                                host_memory.worker_env(cfg.scaling.use_gpu, cfg.scaling.cpus_per_worker)},
            logging_config=LoggingConfig(log_level="INFO" if job.verbose else "WARNING")),
        torch_config=TorchConfig(backend=process_group_backend(cfg.scaling.use_gpu, cfg.fsdp.cpu_offload)),
    )


def train_on_workers(trainer: TorchTrainer, data: Future) -> dict:
    """The worker group trains (Ray Train's result: the final checkpoint's metrics); when the workers stopped
    because the driver could not build the data (they end without an error of their own), that reason is
    raised instead."""
    try:
        metrics = trainer.fit().metrics
    except Exception:
        raise_failure(data)
        raise
    raise_failure(data)
    return metrics


class TrialReports(UserCallback):
    """A sweep trial's reports on their way to Ray Tune: each (rank 0's figures with the checkpoint's path, and
    the checkpoint) goes onto the trial's queue, where app/launch/tune_sweep.py hands it to `tune.report`, so that a
    scheduler can stop the trial on it and PBT can copy the checkpoint into another trial. (Ray's own
    TuneReportCallback passes the figures only, and PBT needs the checkpoints.)"""

    def __init__(self, reports):
        self.reports = reports

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        self.reports.put(({**metrics[0], "checkpoint_path": checkpoint.path if checkpoint else None}, checkpoint))

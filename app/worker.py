"""Ray Train's per-worker entry point: Ray context in, the plain recipe (app/recipe.py) out."""

from __future__ import annotations

from pathlib import Path

import ray.train
import ray.train.torch

from app.config import config_from_dict
from app.recipe import NoTracking, Worker, finetune
from app.tracking import RunLogger


def train_worker(loop_config: dict) -> None:
    cfg = config_from_dict(loop_config["config"])
    context = ray.train.get_context()
    worker = Worker(context.get_world_rank(), context.get_world_size(), ray.train.torch.get_device())
    train_shard = ray.train.get_dataset_shard("train")
    eval_rows = ray.train.get_dataset_shard("eval")  # not split: every rank sees the whole eval set

    def train_batches():
        return train_shard.iter_torch_batches(
            batch_size=cfg.train.micro_batch_size, dtypes=None,
            local_shuffle_buffer_size=cfg.data.shuffle_buffer_rows or None,
            local_shuffle_seed=cfg.train.seed + worker.rank)

    def eval_batches():
        return eval_rows.iter_torch_batches(batch_size=cfg.train.micro_batch_size)

    tracker = RunLogger(cfg.mlflow.tracking_uri, loop_config["mlflow_run_id"]) if worker.rank == 0 else NoTracking()
    try:
        finetune(cfg, worker, train_batches, eval_batches, tracker, adapter_dir=Path(loop_config["adapter_dir"]))
    finally:
        if worker.rank == 0:
            tracker.close()

"""Ray Train's per-worker entry point: Ray context in, the plain recipe (app/train/recipe.py) out.

The driver imports this module only to name `train_worker`: Ray Train and the training stack (torch,
transformers, PEFT, the recipe, distributed checkpointing: seconds of imports) load inside it, in the worker
processes.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from app.config.paths import export_tracking_credentials
from app.config.schema import FinetuneConfig

if TYPE_CHECKING:
    from app.train.checkpoint import TrainerState

# Fault injection for the resilience tests, forwarded to the workers by the driver when set:
FAULT_ENV = "FINETUNE_FAULT_DIE_IN_CHECKPOINT"  # "STEP:MARKER": the last rank dies once mid-save at STEP
# "SECONDS[:STOP_FILE]": each step takes this much longer (until STOP_FILE exists): nodes come and go within a short run
PACE_ENV = "FINETUNE_FAULT_STEP_SECONDS"
# Ray Train 2.60: how often it polls for drains, and how long after noticing one without a deadline it restarts
POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
NO_DEADLINE_RESTART_S = 120.0  # ray.train.v2._internal.constants.DEFAULT_PREEMPTION_DEADLINE_S


class RayCheckpoints:
    """Checkpoints through Ray Train: it uploads each rank's shard into one directory under
    RunConfig.storage_path, keeps the last `train.keep_checkpoints`, and registers a checkpoint only
    once every rank has reported it, so a crash mid-save leaves the previous one as the latest."""

    def __init__(self, rank: int, world_size: int):
        self.is_last_rank = rank == world_size - 1
        self.notice_seen_at: float | None = None

    def restore(self, load) -> TrainerState | None:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            return load(Path(directory))

    def save(self, write, metrics: dict[str, float]) -> None:
        with tempfile.TemporaryDirectory(prefix="finetune-ckpt-") as directory:
            write(Path(directory))
            self._maybe_die_mid_save(metrics["step"])
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))

    def preemption_deadline(self) -> float | None:
        """Ray Train's notice that a node of this group is draining for preemption (a node's SIGTERM, which
        Ray turns into a drain with a 30 s deadline, or `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`);
        a barrier over the ranks. A notice without a deadline gets the one Ray Train applies: it restarts
        the group 120 s after it noticed (a poll interval before this rank could)."""
        _pace_step()
        notice = ray.train.get_preemption_info()
        if notice is None:
            self.notice_seen_at = None
            return None
        if notice.deadline_ms:
            return notice.deadline_ms / 1000
        self.notice_seen_at = self.notice_seen_at or time.time()
        return self.notice_seen_at + NO_DEADLINE_RESTART_S - float(os.environ.get(POLL_ENV, 5.0))

    def _maybe_die_mid_save(self, step: int) -> None:
        """With FINETUNE_FAULT_DIE_IN_CHECKPOINT=STEP:MARKER set, the last rank SIGKILLs itself once,
        at that step, after writing its shard and before Ray has the checkpoint: a crash mid-save."""
        fault = os.environ.get(FAULT_ENV)
        if not (fault and self.is_last_rank):
            return
        at_step, marker = fault.split(":", 1)
        if int(at_step) == step and not os.path.exists(marker):
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)


def _pace_step() -> None:
    """With FINETUNE_FAULT_STEP_SECONDS=SECONDS[:STOP_FILE] set, each step sleeps SECONDS more, until STOP_FILE
    exists (a test that has made its nodes come and go lets the rest of the run go at full speed)."""
    seconds, _, stop_file = os.environ.get(PACE_ENV, "0").partition(":")
    if float(seconds) and not (stop_file and os.path.exists(stop_file)):
        time.sleep(float(seconds))


@dataclass(frozen=True)
class WorkerLaunch:
    """What the driver hands every worker: the validated config, the MLflow run to log to, and the actor
    that gives each rank its shard of every pass over the training data and the eval rows
    (app.data.coordinator.PassCoordinator; they may still be being built when the workers start)."""

    config: FinetuneConfig
    mlflow_run_id: str
    job_start_time: float
    passes: ray.actor.ActorHandle
    source_names: tuple[str, ...]  # the train sources, in the order of the rows' `source` column
    # MLflow credentials the driver took from a tracking URI (they never travel in the config); shipped
    # with the training function, never in a runtime env, job metadata or log
    mlflow_credentials: dict[str, str] = field(default_factory=dict, repr=False)
    init_adapter: ray.ObjectRef | None = None  # model.init_adapter's weights, put in the object store by the driver


def train_worker(launch: WorkerLaunch) -> None:
    from app.train.progress import StartupClock

    startup = StartupClock(launch.job_start_time, memory=True)
    startup.reached("train_fn_started")  # Ray Train's part of the start ends here; the training stack loads next
    import ray.train.torch  # also what RayCheckpoints calls

    from app.data.coordinator import DataNotBuilt, shard_batches
    from app.data.stream import column_batches
    from app.train.ranks import RankContext
    from app.train.recipe import FinetuneRecipe, NoTracking

    cfg = launch.config
    context = ray.train.get_context()
    ctx = RankContext(context.get_world_rank(), context.get_world_size(), ray.train.torch.get_device())
    eval_rows: list[dict] = []  # every rank holds the whole eval set (evaluation deals it out), read once

    def train_pass(epoch: int):
        [rows] = ray.get(launch.passes.shard.remote(epoch, ctx.rank, ctx.world_size))
        return shard_batches(ray.get(rows), cfg.train.micro_batch_size)

    def eval_pass():
        if not eval_rows:
            [rows] = ray.get(launch.passes.eval_rows.remote())
            eval_rows.append(ray.get(rows))
        return column_batches(eval_rows[0], cfg.train.micro_batch_size, ctx.device)

    export_tracking_credentials()  # the config holds the URI without them
    for variable, value in launch.mlflow_credentials.items():
        os.environ.setdefault(variable, value)
    if ctx.is_main:  # only the rank that logs imports MLflow (a second of CPU per process)
        from app.tracking.logger import RunLogger

        tracker = RunLogger(cfg.mlflow.tracking_uri, launch.mlflow_run_id, cfg.run_dir)
    else:
        tracker = NoTracking()
    system = start_system_metrics(cfg, launch.mlflow_run_id) if ctx.is_main else None
    try:
        FinetuneRecipe(cfg, ctx, train_pass, eval_pass, tracker, RayCheckpoints(ctx.rank, ctx.world_size),
                       cfg.run_dir, launch.job_start_time, launch.source_names,
                       ray.get(launch.init_adapter) if launch.init_adapter is not None else None, startup).train()
    except DataNotBuilt:  # the driver says why in one line; a traceback from every rank would bury it
        return
    finally:
        if system is not None:
            system.finish()
        if ctx.is_main:
            tracker.close()


def start_system_metrics(cfg: FinetuneConfig, run_id: str):
    """MLflow's own system-metrics sampler for rank 0's node (a thread; it stops by itself, with a warning,
    if the tracking server stops answering)."""
    if not cfg.mlflow.system_metrics_seconds:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    try:
        monitor = SystemMetricsMonitor(run_id, sampling_interval=cfg.mlflow.system_metrics_seconds,
                                       resume_logging=True, tracking_uri=cfg.mlflow.tracking_uri)
    except Exception as e:  # a tracking server that is down costs the system figures, not the run
        print(f"warning: MLflow system metrics are off for this attempt ({str(e).splitlines()[0][:200]})",
              file=sys.stderr, flush=True)
        return None
    monitor.start()
    return monitor

"""One rank of a run inside Ray Train: Ray's context in (its rank, device, checkpoints, the pass coordinator),
the plain recipe (app/train/recipe.py) out."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ray
import ray.train.torch

from app.config.objectives import objective_of
from app.config.paths import export_tracking_credentials
from app.config.schema import FinetuneConfig
from app.data.coordinator import DataNotBuilt, batches_of
from app.data.stream import column_batches
from app.errors import first_line, warn
from app.launch import worker_hooks
from app.launch.job import TrialLink, WorkerLaunch
from app.launch.rollout_group import RayRollouts, local_scorer, ray_scorer
from app.train.checkpoint import TrainerState
from app.train.group import RankContext
from app.train.ports import NoTracking, RecipeParts
from app.train.progress import StartupClock
from app.train.recipe import FinetuneRecipe
from app.train.side_by_side import SideBySideRecipe

# Ray Train 2.60: how often it polls for drains, and how long after noticing one without a deadline it restarts
POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
# Ray Train 2.60: how often its controller polls the workers; a reported checkpoint is registered at a poll
HEALTH_CHECK_ENV, HEALTH_CHECK_DEFAULT_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0
NO_DEADLINE_RESTART_S = 120.0  # ray.train.v2._internal.constants.DEFAULT_PREEMPTION_DEADLINE_S
TRIAL_DECISION_SECONDS = 600.0  # a sweep's trial waits this long at most for Ray Tune to take its report


class RayCheckpoints:
    """Checkpoints through Ray Train: it uploads each rank's shard into one directory under
    RunConfig.storage_path, keeps the last `train.keep_checkpoints`, and registers a checkpoint only
    once every rank has reported it, so a crash mid-save leaves the previous one as the latest."""

    def __init__(self, rank: int, world_size: int, trial: TrialLink | None = None,
                 before_report: Callable[[], None] | None = None):
        self.is_last_rank, self.is_main = rank == world_size - 1, rank == 0
        self.notice_seen_at: float | None = None
        self.trial, self.before_report = trial, before_report

    def restore(self, load) -> TrainerState | None:
        """The latest checkpoint of this Ray Train run, else the one the run was told to start from."""
        checkpoint = ray.train.get_checkpoint()
        start = self.trial.restore_from if self.trial is not None else None
        if checkpoint is None and start is not None:
            checkpoint = ray.train.Checkpoint(start.path, start.filesystem)
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            return load(Path(directory))

    def save(self, write, metrics: dict[str, float]) -> None:
        with tempfile.TemporaryDirectory(prefix="finetune-ckpt-") as directory:
            write(Path(directory))
            worker_hooks.checkpoint_written(metrics["step"], self.is_last_rank)
            if self.before_report is not None:
                self.before_report()
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        if self.trial is not None and self.is_main:  # the other ranks wait in the next step's collectives
            # a token for an earlier step is one its group's previous attempt did not take (a restart)
            while self.trial.go_on.get(timeout=TRIAL_DECISION_SECONDS) < metrics["step"]:
                pass

    def registration_seconds(self) -> float:
        """A reported checkpoint becomes the one a restart starts from when the controller next polls the workers
        (the poll itself may take as long again): a drain's last save leaves room for both."""
        return 2 * float(os.environ.get(HEALTH_CHECK_ENV, HEALTH_CHECK_DEFAULT_S))

    def preemption_deadline(self) -> float | None:
        """Ray Train's notice that a node of this group is draining for preemption (a node's SIGTERM, which
        Ray turns into a drain with a 30 s deadline, or `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`);
        a barrier over the ranks. A notice without a deadline gets the one Ray Train applies: it restarts
        the group 120 s after it noticed (a poll interval before this rank could)."""
        notice = ray.train.get_preemption_info()
        if notice is None:
            self.notice_seen_at = None
            return None
        if notice.deadline_ms:
            return notice.deadline_ms / 1000
        self.notice_seen_at = self.notice_seen_at or time.time()
        return self.notice_seen_at + NO_DEADLINE_RESTART_S - float(os.environ.get(POLL_ENV, 5.0))


def train_rank(launch: WorkerLaunch, startup: StartupClock) -> None:
    """This rank's part of the run: its device and group, its passes over the data and the eval rows, rank 0's
    MLflow logger and system metrics, then the recipe. Data the driver could not build ends it quietly (the
    driver reports the reason in one line)."""
    plan = launch.plan
    cfg = plan.cfg  # until the recipe has decided what the workers measure: the same but dtypes and compile
    context = ray.train.get_context()
    ctx = RankContext(context.get_world_rank(), context.get_world_size(), ray.train.torch.get_device())
    eval_rows: dict[str, dict] = {}  # every rank holds each whole eval set (evaluation deals it out), read once

    def train_pass(pass_index: int, data: str = ""):
        """This rank's rows of a pass over the job's data, or with `data` an adapter's own (adapters:)."""
        passes = launch.adapter_passes[data] if data else launch.passes
        [rows] = ray.get(passes.rank_rows.remote(pass_index, ctx.rank, ctx.world_size))
        return batches_of(ray.get(rows), plan.rows_per_batch(ctx.world_size))

    def eval_pass(data: str = ""):
        if data not in eval_rows:
            [rows] = ray.get((launch.adapter_passes[data] if data else launch.passes).eval_rows.remote())
            eval_rows[data] = ray.get(rows)
        return column_batches(eval_rows[data], cfg.train.micro_batch_size, ctx.device)

    tracker = rank_tracker(cfg, launch, ctx)
    system = start_system_metrics(cfg, launch.mlflow_run_id) if ctx.is_main else None
    rollouts, scorer = online_sides(cfg, launch, ctx.rank)
    try:
        checkpoints = RayCheckpoints(ctx.rank, ctx.world_size, launch.trial,
                                     # a sweep may stop a trial at any report: what it logged is sent first
                                     tracker.flush if launch.trial and ctx.is_main else None)
        recipe = SideBySideRecipe if cfg.adapters else FinetuneRecipe
        parts = RecipeParts(
            tracker=tracker, checkpoints=checkpoints, run_dir=cfg.run_dir, job_start_time=launch.job_start_time,
            startup=startup, source_names=launch.source_names,
            init_adapter=ray.get(launch.init_adapter) if launch.init_adapter is not None else None,
            teacher=ray.get(launch.teacher) if launch.teacher is not None else None,
            pace=worker_hooks.step_pacing(), rollouts=rollouts, scorer=scorer)
        recipe(plan, ctx, train_pass, eval_pass, parts).train()
    except DataNotBuilt:  # the driver says why in one line; a traceback from every rank would bury it
        return
    finally:
        if system is not None:
            system.finish()
        if ctx.is_main:
            tracker.close()


def rank_tracker(cfg: FinetuneConfig, launch: WorkerLaunch, ctx: RankContext):
    """Rank 0's logger to the job's MLflow run (with the credentials the driver sent), the others' NoTracking."""
    export_tracking_credentials()  # the config holds the URI without them
    for variable, value in launch.mlflow_credentials.items():
        os.environ.setdefault(variable, value)
    if not ctx.is_main:
        return NoTracking()
    from app.tracking.logger import RunLogger  # start-up: only the rank that logs imports MLflow (a second of CPU)

    return RunLogger(cfg.mlflow.tracking_uri, launch.mlflow_run_id, cfg.run_dir,
                     # a PBT copy's first start logs its steps after the copied one anew; a restart of the group
                     # from its own later checkpoint replays what it logged
                     logged_through=launch.trial.copied_step if launch.trial and
                     ray.train.get_checkpoint() is None else None)


def online_sides(cfg: FinetuneConfig, launch: WorkerLaunch, rank: int) -> tuple:
    """An online objective's rollouts (the actors the driver started) as this rank uses them, and GRPO's reward
    scorer (in this worker, or as Ray tasks with grpo.reward_workers); None for what the objective lacks."""
    objective = objective_of(cfg.train)
    if not objective.samples_online:
        return None, None
    specs, tasks = cfg.grpo.reward_funcs, cfg.grpo.reward_workers
    scorer = (ray_scorer(specs, tasks) if tasks else local_scorer(specs)) if objective.rewarded else None
    return RayRollouts(list(launch.rollouts), rank, cfg.rollout.num_generations), scorer


def start_system_metrics(cfg: FinetuneConfig, run_id: str):
    """MLflow's own system-metrics sampler for rank 0's node (a thread; it stops by itself, with a warning,
    if the tracking server stops answering)."""
    if not cfg.mlflow.system_metrics_seconds:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # start-up: rank 0 only

    try:
        monitor = SystemMetricsMonitor(run_id, sampling_interval=cfg.mlflow.system_metrics_seconds,
                                       resume_logging=True, tracking_uri=cfg.mlflow.tracking_uri)
    except Exception as e:  # a tracking server that is down costs the system figures, not the run
        warn(f"MLflow system metrics are off for this attempt ({first_line(e, 200)})")
        return None
    monitor.start()
    return monitor

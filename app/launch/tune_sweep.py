"""Sweeps with Ray Tune: every trial a whole run of this product (its own worker group, checkpoints and MLflow
run, nested under the sweep's), reporting its evaluations to a scheduler that stops the trials behind (ASHA)
or copies the best trials' checkpoints into the worst with perturbed settings (PBT).

Ray Train v2 has no `Tuner(trainer)`: a trial is a Tune function (`run_trial`) that runs the driver
(app/launch/driver.py) in a thread and hands each checkpoint report of its worker group to `tune.report`, with
the checkpoint (PBT copies it into the trials it exploits). The sweep's process keeps the books Ray Tune's
stops leave undone (`TrialBook`) and compares the trials in MLflow at the end (app/tracking/sweep_runs.py).
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
import yaml
from ray import tune
from ray.train._internal.session import get_session
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.util.queue import Queue

from app.config.schema import FinetuneConfig
from app.config.sweep_space import with_values
from app.config.tune import sweep_metric, sweep_mode
from app.errors import first_line, warn
from app.launch.background import in_background
from app.launch.cluster import init_ray
from app.launch.driver import run_finetune
from app.launch.job import TrialLink
from app.runs.layout import ADAPTER_RUN_CONFIG, RunDir
from app.tracking import sweep_runs
from app.tracking.mlflow_run import finish_run
from app.train.checkpoint import TRAINER_STATE, trainer_state

FINISHED = "worker_seconds"  # a key of the run's summary: in a trial's last report only if it trained to its end
SWEEP_RECORD = "sweep.json"  # in the sweep's folder, beside Ray Tune's experiment: what --resume needs


@dataclass(frozen=True)
class Sweep:
    """What every trial and the sweep's books share: its name, the base config, the parent MLflow run, and the
    figure the trials are ranked by."""

    name: str
    cfg: FinetuneConfig
    parent_run_id: str

    @property
    def metric(self) -> str:
        return sweep_metric(self.cfg.tune, self.cfg.train)

    @property
    def mode(self) -> str:
        return sweep_mode(self.cfg.tune, self.cfg.train)

    @property
    def folder(self) -> RunDir:
        """The sweep's folder under train.output_dir: Ray Tune's experiment and the sweep's record."""
        return self.cfg.output.run(self.name)


def trial_config(sweep: Sweep, values: dict, trial_id: str) -> FinetuneConfig:
    """The base config with a trial's values: its own run, nested under the sweep's, evaluated and checkpointed
    at the same steps (every report ranks it, every checkpoint can be copied), the adapter in each checkpoint
    (a trial stopped at any report keeps its adapter of that step)."""
    cfg = with_values(sweep.cfg, values)
    return cfg.with_set({"train.run_name": f"{sweep.name}-{trial_id}", "train.checkpoint_adapter": True,
                         "train.checkpoint_every": cfg.train.eval_every,
                         "train.keep_checkpoints": max(cfg.train.keep_checkpoints, 2),
                         "mlflow.sweep": sweep.name, "mlflow.parent_run_id": sweep.parent_run_id})


def search_space(cfg: FinetuneConfig) -> dict:
    """tune.space as Ray Tune's domains; a grid's values in a random order (tune.seed): ASHA compares each trial
    with those that reached a rung before it, and a grid written from worst to best would let every one pass."""
    order = random.Random(cfg.tune.seed)

    def domain(dimension):
        if dimension.kind == "grid":
            return tune.grid_search(order.sample(dimension.values, len(dimension.values)))
        if dimension.kind == "choice":
            return tune.choice(list(dimension.values))
        return getattr(tune, dimension.kind)(*dimension.values)

    return {key: domain(dimension) for key, dimension in cfg.tune.dimensions().items()}


def scheduler_for(cfg: FinetuneConfig):
    settings, every = cfg.tune, cfg.train.eval_every
    if settings.scheduler == "asha":
        dimensions = settings.dimensions()  # the longest a trial may train, where train.max_steps is swept too
        longest = max(dimensions["train.max_steps"].extremes()) if "train.max_steps" in dimensions else None
        return ASHAScheduler(time_attr="step", max_t=longest or cfg.train.max_steps,
                             grace_period=settings.grace_period or every,
                             reduction_factor=settings.reduction_factor)
    if settings.scheduler == "pbt":
        space, dimensions = search_space(cfg), settings.dimensions()
        mutations = {key: list(dimensions[key].values) if dimensions[key].kind == "grid" else space[key]
                     for key in settings.perturb}  # PBT steps between a grid's values
        return PopulationBasedTraining(time_attr="step", perturbation_interval=settings.perturbation_interval or every,
                                       hyperparam_mutations=mutations,
                                       quantile_fraction=settings.quantile_fraction, synch=settings.synchronous)
    return FIFOScheduler()


def run_trial(values: dict, sweep: Sweep) -> None:
    """One trial, as Ray Tune runs it: the driver in a thread, each report of its worker group handed to Tune with
    its checkpoint, the worker group held until Tune lets it go on (a stop ends this process, and with it the
    worker group, at the report). A trial given a checkpoint (PBT's copy of a better trial, or its own on a
    resumed sweep) continues its own run from it, in a new Ray Train run beside the run's first (whose later
    checkpoints would otherwise win)."""
    cfg = trial_config(sweep, values, tune.get_context().get_trial_id())
    start = tune.get_checkpoint()
    resume = cfg.run_dir.has_record()
    copied_step = note_lineage(cfg, start) if start is not None and resume else None
    part = cfg.train.run_name if start is None else f"{cfg.train.run_name}.part-{uuid.uuid4().hex[:6]}"
    TrialStop.begin()
    link = TrialLink(part, start, copied_step, Queue(actor_options={"num_cpus": 0}),
                     Queue(actor_options={"num_cpus": 0}), trial_stopping)
    training = in_background("trial", run_finetune, cfg, resume, False, None, link)
    training.add_done_callback(lambda _: link.reports.put(None))
    try:
        hand_reports_to_tune(link, training, sweep.metric)
    except SystemExit:  # how tune.report ends a trial it stops (clearing the session's stop event as it does)
        TrialStop.at_report.set()
        raise
    try:
        training.result()  # the run's own error, if it failed
    except Exception:
        if trial_stopping():  # the worker group died with the stopping trial: no error of its own; Ray Tune
            time.sleep(STOPPING_GRACE_S)  # ends this process, the sweep ends its run KILLED
        raise


def hand_reports_to_tune(link: TrialLink, training, metric: str) -> None:
    """Each report of the trial's worker group to Ray Tune, with its checkpoint; the group goes on when Tune lets it."""
    while (item := link.reports.get()) is not None:
        report, checkpoint = item
        last = FINISHED in report
        if last:  # the run records itself first: Ray Tune may end this process on its last report
            link.go_on.put(report["step"])
            training.result()
        if last or metric in report:  # not a drain's checkpoint between evaluations: nothing to rank
            tune.report(report, checkpoint=checkpoint and tune.Checkpoint(checkpoint.path, checkpoint.filesystem))
        if not last:  # tune.report returned: the scheduler lets the trial go on
            link.go_on.put(report["step"])


STOPPING_GRACE_S = 60.0


class TrialStop:
    """Whether Ray Tune is stopping this process's trial, before the process ends and the trial's worker group with
    it. Tune's stop sets the trial session's stop event (Trainable.stop -> session.finish) and drops the session
    right after (shutdown_session), so the session is held from the trial's start; a stop that finds the trial
    inside tune.report clears the event as it ends the trial with SystemExit, which the trial notes (`at_report`).
    Ray's own session object: no public call tells it. Class state: the check travels to the workers and pickles."""

    session = None
    at_report = threading.Event()

    @classmethod
    def begin(cls) -> None:
        """A trial starts in this process (Ray Tune may reuse a process, one trial at a time)."""
        cls.session = get_session()
        cls.at_report.clear()


def trial_stopping() -> bool:
    session = TrialStop.session
    return TrialStop.at_report.is_set() or bool(session is not None and session.stop_event.is_set())


def note_lineage(cfg: FinetuneConfig, start) -> int | None:
    """A checkpoint of another trial (PBT exploited this one): which, at which step, what changed, on the run;
    returns that step (None for the trial's own checkpoint: a resumed sweep). The trial logs its steps after it
    again: what it logged past it before the copy was another trajectory."""
    with start.as_directory() as directory:
        origin = yaml.safe_load((Path(directory) / "adapter" / ADAPTER_RUN_CONFIG).read_text())
        step = trainer_state((Path(directory) / TRAINER_STATE).read_text()).step
    if origin["train"]["run_name"] == cfg.train.run_name:
        return None
    changes = []
    for key in cfg.tune.perturb:
        section, name = key.split(".")
        before, now = origin[section][name], getattr(getattr(cfg, section), name)
        if before != now:
            changes.append(f"{key} {before!r} -> {now!r}")
    sweep_runs.record_lineage(cfg.mlflow.tracking_uri, cfg.run_dir.recorded_mlflow_run_id(),
                              origin["train"]["run_name"], step, ", ".join(changes))
    return step


class TrialBook(tune.Callback):
    """The end of a trial's MLflow run where Ray Tune ended the trial's process before it could end the run itself
    (a scheduler's stop): in the sweep's process, from what each trial reported last."""

    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        self.last: dict[str, dict] = {}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.last[trial.trial_id] = {**result, "config": dict(trial.config)}

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = self.last.get(trial.trial_id)
        if result is None or FINISHED in result:
            return  # never reported, or trained to its end: its run ended itself
        cfg = trial_config(self.sweep, result["config"], trial.trial_id)
        checkpoint = result.get("checkpoint_path")
        adapter = Path(checkpoint) / "adapter" if checkpoint and Path(checkpoint).is_absolute() else None  # local
        sweep_runs.end_stopped_trial(cfg, cfg.run_dir.recorded_mlflow_run_id(), int(result["step"]),
                                     self.sweep.cfg.tune.scheduler, adapter)


def trials_at_once(cfg: FinetuneConfig) -> int:
    """tune.max_concurrent, or as many worker groups as the cluster's CPUs (GPUs) hold: the other trials queue."""
    if cfg.tune.max_concurrent:
        return cfg.tune.max_concurrent
    scaling = cfg.scaling
    unit, per_worker = ("GPU", 1) if scaling.use_gpu else ("CPU", scaling.cpus_per_worker)
    return max(1, int(ray.cluster_resources().get(unit, 0) // (per_worker * scaling.num_workers)))


def tuner_for(sweep: Sweep, book: TrialBook, resume: bool, verbose: bool = False) -> tune.Tuner:
    trainable = tune.with_resources(tune.with_parameters(run_trial, sweep=sweep),
                                    {"CPU": 0.01})  # a token share: its worker group reserves the CPUs
    if resume:
        return tune.Tuner.restore(sweep.folder.root, trainable, resume_unfinished=True, resume_errored=True)
    settings = sweep.cfg.tune
    return tune.Tuner(
        trainable, param_space=search_space(sweep.cfg),
        tune_config=tune.TuneConfig(metric=sweep.metric, mode=sweep.mode, scheduler=scheduler_for(sweep.cfg),
                                    num_samples=settings.num_samples, reuse_actors=False,
                                    search_alg=BasicVariantGenerator(max_concurrent=trials_at_once(sweep.cfg),
                                                                     random_state=settings.seed)),
        run_config=tune.RunConfig(name=sweep.name, storage_path=sweep.cfg.train.output_dir, callbacks=[book],
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=3),
                                  verbose=1 if verbose else 0))


def start_sweep(cfg: FinetuneConfig, name: str) -> Sweep:
    """A new sweep: its parent MLflow run, and the record --resume reads back."""
    sweep = Sweep(name, cfg, sweep_runs.open_parent_run(cfg, name))
    sweep.folder.write_text(json.dumps({"parent_run_id": sweep.parent_run_id, "config": cfg.to_yaml()}), SWEEP_RECORD)
    return sweep


def resumed_sweep(cfg: FinetuneConfig, name: str) -> Sweep:
    record = json.loads(cfg.output.run(name).read_text(SWEEP_RECORD))
    sweep = Sweep(name, FinetuneConfig.model_validate(yaml.safe_load(record["config"])), record["parent_run_id"])
    sweep_runs.reopen_parent_run(sweep.cfg.mlflow.tracking_uri, sweep.parent_run_id)
    return sweep


def trial_rows(sweep: Sweep, results) -> list[dict]:
    """One row per trial that reported (from Ray Tune's results, also those of a resumed sweep's earlier part):
    its run, how it ended, its values, its last figure and steps."""
    rows = []
    for result in results:
        if not result.metrics or "step" not in result.metrics:
            continue
        cfg = trial_config(sweep, result.config, result.metrics["trial_id"])
        run_id = cfg.run_dir.recorded_mlflow_run_id()
        status = "finished" if FINISHED in result.metrics else sweep_runs.trial_status(cfg.mlflow.tracking_uri, run_id)
        value = result.metrics.get(sweep.metric)
        rows.append({"run": cfg.train.run_name, "run_id": run_id, "status": status, **result.config,
                     sweep.metric: value if value is None or math.isfinite(value) else None,
                     "steps": int(result.metrics["step"]), "adapter": cfg.run_dir.adapter})
    return rows


def best_row(sweep: Sweep, rows: list[dict]) -> dict | None:
    """The best trial by the sweep's metric: among those that trained to their end, if any did."""
    finished = [r for r in rows if r["status"] == "finished" and r[sweep.metric] is not None]
    ranked = finished or [r for r in rows if r[sweep.metric] is not None]
    if not ranked:
        return None
    return (min if sweep.mode == "min" else max)(ranked, key=lambda r: r[sweep.metric])


def run_sweep(cfg: FinetuneConfig, name: str, resume: bool = False, verbose: bool = False) -> dict:
    """The sweep to its end (or to a Ctrl-C / `ray job stop`, after which --resume continues it without rerunning
    finished trials); the trials compared on the parent MLflow run; returns the summary."""
    init_ray(verbose)
    sweep = resumed_sweep(cfg, name) if resume else start_sweep(cfg, name)
    status, rows, failures, tracking_uri = "FAILED", [], [], sweep.cfg.mlflow.tracking_uri
    try:
        results = tuner_for(sweep, TrialBook(sweep), resume, verbose).fit()
        rows, failures = trial_rows(sweep, results), [first_line(e, 300) for e in results.errors]
        for failure in failures:
            warn(f"a trial failed: {failure}")
        status = "KILLED" if sweep_runs.end_interrupted_trials(sweep.cfg, name) else "FINISHED"
        best = best_row(sweep, rows)
        sweep_runs.log_comparison(tracking_uri, sweep.parent_run_id, rows, sweep.metric, best)
    except BaseException as e:  # a second Ctrl-C (Ray Tune stops at once), or Tune's own failure
        status = "FAILED" if isinstance(e, Exception) else "KILLED"
        sweep_runs.end_interrupted_trials(sweep.cfg, name)
        raise
    finally:
        finish_run(tracking_uri, sweep.parent_run_id, status, sweep.folder)
    return sweep_summary(sweep, rows, best, status) | {"trials_failed": len(failures)}


def sweep_summary(sweep: Sweep, rows: list[dict], best: dict | None, status: str) -> dict:
    """What the sweep found and what it spent: the steps its trials trained against every trial to the end."""
    spent = sum(r["steps"] for r in rows)
    full = sum(r.get("train.max_steps", sweep.cfg.train.max_steps) for r in rows)
    keys = list(sweep.cfg.tune.space)
    return {"sweep": sweep.name, "status": status, "parent_run_id": sweep.parent_run_id,
            "tracking_uri": sweep.cfg.mlflow.tracking_uri, "experiment": sweep.cfg.mlflow.experiment,
            "scheduler": sweep.cfg.tune.scheduler, "metric": sweep.metric, "mode": sweep.mode, "trials": len(rows),
            "steps_spent": spent, "steps_to_the_end": full,
            "steps_saved_fraction": round(1 - spent / full, 3) if full else None,
            "trials_table": [{k: r[k] for k in ("run", "status", *keys, sweep.metric, "steps")} for r in rows],
            "best": None if best is None else {"run": best["run"], "value": best[sweep.metric],
                                               "config": {k: best[k] for k in keys}, "adapter": best["adapter"]}}

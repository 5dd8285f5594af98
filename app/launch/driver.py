"""The driver of a run, in named steps: check the inputs and plan the run (app/plan/: what `auto` and the
model's source become, each decided once), join or start Ray, claim the run, open its MLflow run, build the
data and the worker group, train, record.

Order matters: everything a user can get wrong is checked before any worker starts, what reads only files
before Ray starts, so a typo costs seconds, not a worker group's start. What overlaps: the checks that load
the model stack run while Ray starts (a local cluster this job started is stopped again if they fail), and
the data is built while Ray Train starts the worker group. Importing this module takes Ray and the config
alone: the model stack, Ray Train, Ray Data and MLflow load while Ray starts, in the steps that use them.
"""

from __future__ import annotations

import _thread
import signal
import time

import ray

from app.config.distill import DistillSection
from app.config.objectives import objective_of
from app.config.paths import export_tracking_credentials
from app.config.schema import FinetuneConfig
from app.errors import UserInputError
from app.launch.background import in_background
from app.launch.cluster import check_placement, init_ray, rollout_resources
from app.launch.inputs import (
    CheckedInputs,
    CheckedSources,
    check_resumed_data,
    check_tracking_server,
    plan_files,
)
from app.launch.job import Job, TrialLink
from app.launch.summary import job_summary
from app.plan.plan import Plan
from app.plan.rollout_sizing import rollout_decisions
from app.runs.claim import check_run_dir, claimed_run
from app.train.progress import StartupClock


def run_finetune(cfg: FinetuneConfig, resume: bool = False, verbose: bool = False,
                 started_at: float | None = None, trial: TrialLink | None = None) -> dict:
    """Check, launch, train, record; returns the one-line JSON summary as a dict.

    With `resume`, continues the run of the same `train.run_name` from its latest checkpoint, in the
    same MLflow run, with whatever worker count the config now asks for. The summary comes from the
    workers through Ray Train: a tracking server that is down at the end costs a warning, not the run.
    `started_at`: when the job began (the command's process start: the timeline then counts the driver's
    imports too); now, if not given. `trial`: the run is a sweep's trial (app/launch/tune_sweep.py).
    """
    t0 = time.perf_counter()
    export_tracking_credentials()  # the config holds the tracking URI without them
    startup = StartupClock(started_at or time.time())
    if started_at is not None:
        startup.reached("driver_ready")
    plan, sources = plan_files(cfg)
    check_tracking_server(cfg.mlflow.tracking_uri)
    check_run_dir(cfg.run_dir, resume)
    if resume:
        check_resumed_data(cfg.run_dir, *sources.every_train_source())
    plan, inputs = checked_while_ray_starts(plan, sources, startup, verbose)
    plan = plan.decided(*rollout_decisions(plan.cfg, ray.cluster_resources().get("GPU", 0.0)))
    check_placement(plan.cfg)
    from app.launch.memory_budget import memory_decisions, rollout_actor_line  # start-up: loaded by the checks

    decisions, memory = memory_decisions(plan.cfg)
    plan = plan.decided(*decisions)
    print_plan(plan, rollout_actor_line(memory))
    claim = ClaimWatch()
    with claimed_run(cfg.run_dir, resume, on_lost=claim.lost) as run_to_continue:
        from app.launch import recording  # start-up: MLflow, loaded by the checks' thread meanwhile

        run_id = recording.open_mlflow_run(plan, inputs, run_to_continue)
        job = Job(plan, inputs, run_id, startup, verbose, trial)
        startup.reached("mlflow_run_ready")
        metrics, model, mlflow_synced = train_and_record(job, claim)
    return job_summary(plan.cfg, job.run_id, metrics, startup, mlflow_synced, model,
                       wall_seconds=time.perf_counter() - t0)


def checked_while_ray_starts(plan: Plan, sources: CheckedSources, startup: StartupClock,
                             verbose: bool) -> tuple[Plan, CheckedInputs]:
    """Ray starts (or is joined) while a thread runs the checks that load the model stack; a local cluster
    this call started is stopped again if they fail: nothing of this job is left running."""
    checked = in_background("checks", model_stack_checked_in_thread, plan, sources, startup)
    started_ray = init_ray(verbose, extra_cpus=rollout_resources(plan.cfg)[0])
    startup.reached("ray_ready")
    try:
        return checked.result()
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise


def model_stack_checked_in_thread(plan: Plan, sources: CheckedSources,
                                  startup: StartupClock) -> tuple[Plan, CheckedInputs]:
    from app.launch.model_checks import model_stack_checked  # start-up: the model stack loads beside Ray's processes

    return model_stack_checked(plan, sources, startup)


def print_plan(plan: Plan, *notes: str | None) -> None:
    """What the driver decided for the run, one line each, and its notes (the workers print what they measure)."""
    for key, why in plan.reasons.items():
        print(f"plan: {key}={why}", flush=True)
    for note in filter(None, notes):
        print(f"plan: {note}", flush=True)
    if objective_of(plan.cfg.train).taught:
        print(f"plan: {where_the_teacher_scores(plan.cfg.distill)}", flush=True)


def where_the_teacher_scores(distill: DistillSection) -> str:
    """Distillation's teacher, as the plan prints it: where it scores and what it costs."""
    if distill.teacher is None:
        return (f"distill.teacher_adapter={distill.teacher_adapter} (scored on the trainer workers: a frozen second "
                "adapter on their sharded base, one forward without gradients per micro-batch, no second copy of the "
                "base; counted in the memory plan)")
    beside = f", with distill.teacher_adapter={distill.teacher_adapter} beside it" if distill.teacher_adapter else ""
    return (f"distill.teacher={distill.teacher} (scored on the trainer workers: sharded over them as the student is "
            f"and frozen{beside}, one "
            "forward without gradients per micro-batch; counted in the memory plan)")


def train_and_record(job: Job, claim: ClaimWatch) -> tuple[dict, dict[str, str], bool]:
    """GRPO's rollout actors started, the data built (beside the worker group's start where it fits), the workers
    trained, the MLflow run tagged with its best evaluation, the adapter logged as a model, and the run ended with
    its real status (journaled if MLflow is down): (Ray Train's final metrics, the logged model's URIs, whether
    MLflow has everything). A run whose claim another job took over is stopped and left to that job: its MLflow
    run untouched, the reason raised in one line."""
    from app.launch import data_build, recording, rollout_group, trainer  # start-up: Ray Data, Train, once Ray is up

    status, rollouts = "FAILED", []
    try:
        rollouts = rollout_group.start_rollout_group(job.cfg) if objective_of(job.cfg.train).samples_online else []
        passes, data = data_build.start_data(job)
        metrics = trainer.train_on_workers(trainer.build_trainer(job, passes, rollouts), data)
        claim.raise_if_lost()
        status = "FINISHED"
        model = recording.record_outcome(job.cfg, job.run_id, metrics)
        if job.cfg.train.eval_tasks:
            recording.score_on_eval_tasks(job.cfg, job.run_id, model)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM from `ray job stop` (ray.init's handler exits)
        claim.raise_if_lost()
        status = "KILLED"
        raise
    except Exception:
        claim.raise_if_lost()  # the aborted workers' error is not the reason
        if job.trial and job.trial.stopping and job.trial.stopping():
            status = None  # a sweep's trial stopped with its sweep: the sweep ends the run (KILLED, interrupted)
        raise
    finally:
        rollout_group.stop_rollout_group(rollouts)
        ended = claim.reason is None and status is not None
        mlflow_synced = recording.end_run(job.cfg, job.run_id, status) if ended else False
    return metrics, model, mlflow_synced


class ClaimWatch:
    """What the driver does when its claim on the run is found taken by another job (this one was cut off from
    the storage past its lease, and the run was taken over): it stops the run (as Ctrl-C would: Ray Train aborts
    the worker group) and ends with the reason, writing nothing more to the run or its MLflow run."""

    def __init__(self):
        self.reason: str | None = None

    def lost(self, reason: str) -> None:
        self.reason = reason
        _thread.interrupt_main(signal.SIGINT)

    def raise_if_lost(self) -> None:
        if self.reason is not None:
            raise UserInputError(self.reason) from None

"""A run as the launch hands it on: the driver's Job (what every launching step reads) and the WorkerLaunch
every worker is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.config.schema import FinetuneConfig
from app.launch.inputs import CheckedInputs
from app.train.progress import StartupClock

if TYPE_CHECKING:  # the handles' types: this module itself needs no Ray
    import ray


@dataclass(frozen=True)
class Job:
    """The config as the workers will read it, every checked input, the MLflow run, the start-up clock (on
    which `startup.job_start_time` is the job's start), and whether Ray's own lines are shown."""

    cfg: FinetuneConfig
    inputs: CheckedInputs
    run_id: str
    startup: StartupClock
    verbose: bool = False


@dataclass(frozen=True)
class WorkerLaunch:
    """What the driver hands every worker: the validated config, the MLflow run to log to, and the actor
    that gives each rank its rows of every pass over the training data and the eval rows
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
    rollouts: tuple = ()  # GRPO's rollout actors (app/launch/rollout_group.py)

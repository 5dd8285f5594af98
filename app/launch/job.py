"""A run as the launch hands it on: the driver's Job (what every launching step reads) and the WorkerLaunch
every worker is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args

from pydantic import BaseModel

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
    trial: TrialLink | None = None


# What may still read `auto` when the workers start: what only they can measure (whether their hardware computes
# bf16; whether compiling pays on it, timed on rank 0) and a per-record mode (data.format); the driver decides the rest.
MEASURED_ON_WORKERS = frozenset({"model.dtype", "fsdp.param_dtype", "model.compile"})
PER_RECORD_MODES = frozenset({"data.format"})


def autos_left(cfg: FinetuneConfig) -> list[str]:
    """The keys whose type admits `auto` and whose value is still `auto`, dotted (a run named "auto" is no choice)."""
    return [f"{name}.{key}" for name in type(cfg).model_fields if isinstance(section := getattr(cfg, name), BaseModel)
            for key, field in type(section).model_fields.items()
            if _admits_auto(field.annotation) and getattr(section, key) == "auto"]


def _admits_auto(annotation) -> bool:
    return annotation == "auto" if isinstance(annotation, str) else any(map(_admits_auto, get_args(annotation)))


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
    trial: TrialLink | None = None  # a sweep's trial: where it starts, and that its reports may be its last

    def __post_init__(self):
        undecided = [key for key in autos_left(self.config) if key not in MEASURED_ON_WORKERS | PER_RECORD_MODES]
        if undecided:  # a launch step skipped: the workers would read `auto` where they expect a size or a choice
            raise ValueError(f"{undecided[0]}=auto would reach the workers; the driver resolves it before they start "
                             "(app/launch/memory_budget.py)")


@dataclass(frozen=True)
class TrialLink:
    """What a sweep's trial (app/launch/tuning.py) adds to a run: the Ray Train run it trains in (its first
    part trains in the run's own; one restarted from a checkpoint, PBT's copy of a better trial or a resumed
    sweep's, in a new one beside it), that checkpoint, the queue its reports go to Ray Tune through, and the
    one on which rank 0 waits after each report until Ray Tune's scheduler has let the trial go on (a trial it
    stops or pauses trains no step past the report)."""

    train_run_name: str
    restore_from: object = None  # a ray.tune.Checkpoint (its path and filesystem: local, NFS or an object store)
    copied_step: int | None = None  # the step of another trial's checkpoint it starts from: logged anew after it
    reports: object = None  # ray.util.queue.Queues: filled by app/launch/trainer.py's TrialReports callback,
    go_on: object = None  # and by the trial function once Ray Tune has taken the report
    stopping: object = None  # () -> bool: Ray Tune is stopping the trial (Ctrl-C, `ray job stop` of the sweep)

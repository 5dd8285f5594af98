"""A run as the launch hands it on: the driver's Job (what every launching step reads) and the WorkerLaunch
every worker is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.config.schema import FinetuneConfig
from app.launch.inputs import CheckedInputs
from app.plan.plan import Plan
from app.train.progress import StartupClock

if TYPE_CHECKING:  # the handles' types: this module itself needs no Ray
    import ray


@dataclass(frozen=True)
class Job:
    """The run's plan (what the user asked and what the driver decided), every checked input, the MLflow run,
    the start-up clock (on which `startup.job_start_time` is the job's start), and whether Ray's own lines are
    shown."""

    plan: Plan
    inputs: CheckedInputs
    run_id: str
    startup: StartupClock
    verbose: bool = False
    trial: TrialLink | None = None

    @property
    def cfg(self) -> FinetuneConfig:
        """The config with the driver's decisions: what the launching steps read."""
        return self.plan.cfg


@dataclass(frozen=True)
class WorkerLaunch:
    """What the driver hands every worker: the run's plan, the MLflow run to log to, and the actor
    that gives each rank its rows of every pass over the training data and the eval rows
    (app.data.coordinator.PassCoordinator; they may still be being built when the workers start), and one such
    actor for each adapter with data of its own."""

    plan: Plan
    mlflow_run_id: str
    job_start_time: float
    passes: ray.actor.ActorHandle
    source_names: tuple[str, ...]  # the train sources, in the order of the rows' `source` column
    # MLflow credentials the driver took from a tracking URI (they never travel in the config); shipped
    # with the training function, never in a runtime env, job metadata or log
    mlflow_credentials: dict[str, str] = field(default_factory=dict, repr=False)
    init_adapter: ray.ObjectRef | None = None  # model.init_adapter's weights, put in the object store by the driver
    teacher: ray.ObjectRef | None = None  # distill.teacher_adapter's settings and weights (a FrozenAdapter), likewise
    rollouts: tuple = ()  # the rollout actors of GRPO or distillation (app/launch/rollout_group.py)
    trial: TrialLink | None = None  # a sweep's trial: where it starts, and that its reports may be its last
    adapter_passes: dict = field(default_factory=dict)  # adapters with data of their own: name -> its coordinator

    def __post_init__(self):
        # a launch step skipped: the workers would read `auto` where they expect a size or a choice
        if undecided := self.plan.undecided():
            raise ValueError(f"{undecided[0]}=auto would reach the workers; the driver resolves it before they start "
                             "(app/launch/memory_budget.py, app/plan/memory_choices.py)")


@dataclass(frozen=True)
class TrialLink:
    """What a sweep's trial (app/launch/tune_sweep.py) adds to a run: the Ray Train run it trains in (its first
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

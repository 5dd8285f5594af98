"""The run's plan: the config as the user wrote it, and every value the run decided for it, each once, with its
reason. The config is never rewritten: a plan applies its decisions to a copy of what was asked and validates
that copy again with every rule of the config (app/config/rules.py), so a decided value breaks no rule unseen.

Who decides what: the driver (app/launch/driver.py) the model's folder (a GGUF file dequantized, a packaged model
built), a hub model's commit, whether sharded loading works, and the speed-for-memory `auto` values
(app/plan/memory_choices.py); the workers (app/train/measured.py) what only their hardware can tell, the compute
dtypes and whether compiling pays. The workers receive the plan, never the bare config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from app.config.objectives import objective_of
from app.config.schema import FinetuneConfig
from app.errors import UserInputError

# What may still read `auto` when the workers start: what only they can measure (whether their hardware computes
# bf16; whether compiling pays on it, timed on rank 0) and a per-record mode (data.format); the driver decides the rest.
MEASURED_ON_WORKERS = frozenset({"model.dtype", "fsdp.param_dtype", "model.compile"})
PER_RECORD_MODES = frozenset({"data.format"})


@dataclass(frozen=True)
class Decision:
    """One config key's value as the run takes it; `reason` is what the job prints (`auto: key=reason`) and tags
    the MLflow run with; a value that follows from another decision carries none."""

    key: str  # section.key
    value: Any
    reason: str = ""


@dataclass(frozen=True)
class Plan:
    requested: FinetuneConfig  # as loaded: the user's file and --set overrides, paths absolute, defaults named
    decisions: tuple[Decision, ...] = ()
    cfg: FinetuneConfig = field(init=False, repr=False)  # `requested` with the decisions, validated anew

    def __post_init__(self):
        keys = [d.key for d in self.decisions]
        if twice := next((key for key in keys if keys.count(key) > 1), None):
            raise RuntimeError(f"{twice} was decided twice; each value of a plan is decided once")
        object.__setattr__(self, "cfg", applied(self.requested, self.decisions))

    def decided(self, *decisions: Decision) -> Plan:
        return Plan(self.requested, self.decisions + decisions)

    @property
    def reasons(self) -> dict[str, str]:
        """Config key -> the value decided and why, for every decision with a reason."""
        return {d.key: d.reason for d in self.decisions if d.reason}

    def undecided(self) -> list[str]:
        """The keys still `auto` that the driver decides (what the workers measure and per-record modes aside)."""
        return [key for key in autos_left(self.cfg) if key not in MEASURED_ON_WORKERS | PER_RECORD_MODES]

    def grad_accum_steps_on(self, workers: int) -> int:
        """Micro-batches per optimizer step on `workers` workers: the global batch is the same on any count."""
        train = self.cfg.train
        if train.micro_batch_size == "auto":
            raise UserInputError("train.micro_batch_size=auto: the micro-batch, and so the accumulation steps, is "
                                 "chosen from the memory plan when the job starts (`python -m jobs.plan` prints it); "
                                 "give a number to know it before")
        return train.global_batch_size // (train.micro_batch_size * workers)

    @property
    def grad_accum_steps(self) -> int:
        return self.grad_accum_steps_on(self.cfg.scaling.num_workers)

    def rows_per_batch(self, workers: int) -> int:
        """Rows of the training data a rank takes at a time (the objective's Objective.rows_per_batch)."""
        return objective_of(self.cfg.train).rows_per_batch(self.cfg.train, self.cfg.rollout, workers)


def applied(requested: FinetuneConfig, decisions: tuple[Decision, ...]) -> FinetuneConfig:
    """A new config: what was asked with the decided values, through the config's validation again."""
    try:
        return requested.with_set({decision.key: decision.value for decision in decisions})
    except ValidationError as e:  # a resolver's defect, not the user's: the decisions say which
        raise RuntimeError(f"the plan's decisions {[d.key for d in decisions]} break a rule of the config: "
                         f"{e.errors()[0]['msg']}") from None


def autos_left(cfg: FinetuneConfig) -> list[str]:
    """The keys whose type admits `auto` and whose value is still `auto`, dotted (a run named "auto" is no choice)."""
    return [f"{name}.{key}" for name in type(cfg).model_fields if isinstance(section := getattr(cfg, name), BaseModel)
            for key, field_ in type(section).model_fields.items()
            if _admits_auto(field_.annotation) and getattr(section, key) == "auto"]


def _admits_auto(annotation) -> bool:
    return annotation == "auto" if isinstance(annotation, str) else any(map(_admits_auto, get_args(annotation)))

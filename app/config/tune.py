"""The `tune:` section: a sweep over the run config with Ray Tune (`python -m jobs.tune`), ignored by a single
run. The search space maps config keys to distributions written as text (`loguniform(1e-4,3e-3)`); this module
reads that text into `Dimension`s, and checks what one section can. Whether each key exists and each value it
may take makes a valid run is app/config/sweep_space.py's check, which needs the whole config."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator

from app.config.objectives import LOWER_IS_BETTER
from app.config.sections import Section, TrainSection

KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
DIMENSION = re.compile(r"\s*(?P<kind>[a-z]+)\s*\((?P<args>.*)\)\s*", re.S)
# what PBT may change in a running trial: read from the config at every step or restored into the optimizer on
# a restart (app/train/recipe.py); a shape (lora.r) or the data cannot change mid-run
PERTURBABLE = ("train.learning_rate", "train.weight_decay", "train.max_grad_norm")


@dataclass(frozen=True)
class Dimension:
    """One key's distribution: grid(values...) (every value, in every sample), choice(values...), uniform(low,
    high), loguniform(low, high), randint(low, high) (high exclusive, as Ray Tune's)."""

    kind: str
    values: tuple

    def extremes(self) -> tuple:
        """The values the check before the sweep validates: every choice, or both ends of a range."""
        if self.kind == "randint":
            return self.values[0], self.values[1] - 1
        return self.values


def parse_dimension(key: str, text: str) -> Dimension:
    """`loguniform(1e-4,3e-3)` -> Dimension("loguniform", (1e-4, 3e-3)); a mistake is one line naming the key."""
    example = "e.g. loguniform(1e-4,3e-3), uniform(0,0.1), randint(1,4), choice(8,16,32)"
    found = DIMENSION.fullmatch(str(text))
    if not found or found["kind"] not in KINDS:
        raise ValueError(f"tune.space {key}={text}: expected one of {', '.join(KINDS)} with its values, {example}")
    try:
        values = tuple(_value(v) for v in found["args"].split(",") if v.strip())
    except yaml.YAMLError:
        raise ValueError(f"tune.space {key}={text}: its values are not a comma-separated list, {example}") from None
    kind = found["kind"]
    if kind in ("grid", "choice"):
        if not values:
            raise ValueError(f"tune.space {key}={text}: {kind} needs at least one value")
        return Dimension(kind, values)
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"tune.space {key}={text}: {kind} takes two numbers, low and high")
    low, high = values
    if not low < high or (kind == "loguniform" and low <= 0) or (kind == "randint" and not isinstance(low, int)):
        raise ValueError(f"tune.space {key}={text}: needs low < high" + (", both above 0" if kind == "loguniform"
                         else ", whole numbers" if kind == "randint" else ""))
    return Dimension(kind, (low, high))


def _value(text: str):
    """A value as YAML reads it, and `1e-4` as the number YAML 1.1 (PyYAML) leaves a string without a dot."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


class TuneSection(Section):
    """A sweep with Ray Tune (`python -m jobs.tune`): trials sampled from the space, each a whole run of this
    config with its own worker group, checkpoints and MLflow run (nested under the sweep's), reporting its
    evaluations at every train.eval_every; a scheduler stops the trials that fall behind (asha) or copies the
    best trials' checkpoints into the worst with perturbed settings (pbt)."""

    space: dict[str, str] = Field({}, description="config key -> distribution: grid(a,b,...) (every value, in "
                                  "a random order: tune.seed), "
                                  "choice(a,b,...), uniform(lo,hi), loguniform(lo,hi), randint(lo,hi) (hi "
                                  "exclusive), e.g. "
                                  "{train.learning_rate: loguniform(1e-4,3e-3), lora.r: choice(8,16,32)}")
    num_samples: int = Field(8, gt=0, description="samples of the space; with grid() keys each sample is every "
                             "combination of their values (num_samples=1: the grid once)")
    max_concurrent: int | None = Field(None, gt=0, description="trials running at once; None: as many worker "
                                       "groups as the cluster's CPUs (or GPUs) hold, the others queue")
    metric: str | None = Field(None, description="the evaluation figure the scheduler ranks trials by (any that "
                               "train.best_metric may name); None: train.best_metric")
    mode: Literal["min", "max"] | None = Field(None, description="whether lower or higher tune.metric is better; "
                                               "None: min for losses and perplexity, max otherwise")
    scheduler: Literal["asha", "pbt", "fifo"] = Field("asha", description="asha: stop trials behind at each rung; "
                                                      "pbt: population based training; fifo: every trial to the end")
    grace_period: int | None = Field(None, gt=0, description="asha: steps every trial trains before it may be "
                                     "stopped; None: train.eval_every")
    reduction_factor: float = Field(2.0, gt=1.0, description="asha: 1 in this many trials goes on at each rung")
    perturbation_interval: int | None = Field(None, gt=0, description="pbt: steps between exploit/explore "
                                              "decisions (a multiple of train.eval_every); None: train.eval_every")
    quantile_fraction: float = Field(0.25, gt=0.0, le=0.5, description="pbt: the share of trials that copy (bottom) "
                                     "and are copied (top)")
    synchronous: bool = Field(False, description="pbt: every trial waits at each decision until all have reached "
                              "it, so each decision ranks the whole population (a trial that waits is paused and "
                              "restarted from its checkpoint); otherwise each trial decides on the others' latest")
    perturb: list[str] = Field([], description=f"pbt: the keys of tune.space it may change mid-run "
                               f"({', '.join(PERTURBABLE)}); its values are resampled or scaled by 0.8/1.2")
    seed: int | None = Field(None, description="seeds the sampling of the space and the order of a grid's values "
                             "(None: a new sweep each time)")
    in_one_job: bool = Field(False, description="the trials as adapters of one job over one base (`jobs.tune "
                             "--in-one-job`, set by it): asha stops adapters at its rungs (train.eval_every steps "
                             "apart at least), fifo trains every one to the end")

    @field_validator("space")
    @classmethod
    def _dimensions_parse(cls, space: dict[str, str]) -> dict[str, str]:
        for key, text in space.items():
            parse_dimension(key, text)
        return space

    @model_validator(mode="after")
    def _perturb_within_space(self) -> TuneSection:
        for key in self.perturb:
            if key not in PERTURBABLE:
                raise ValueError(f"tune.perturb {key}: PBT can change only {', '.join(PERTURBABLE)} in a running trial")
            if key not in self.space:
                raise ValueError(f"tune.perturb {key}: not in tune.space; give it a distribution there too")
        if self.scheduler == "pbt" and not self.perturb:
            raise ValueError("tune.scheduler=pbt needs tune.perturb: the keys it may change, e.g. train.learning_rate")
        return self

    def dimensions(self) -> dict[str, Dimension]:
        return {key: parse_dimension(key, text) for key, text in self.space.items()}


def sweep_metric(tune: TuneSection, train: TrainSection) -> str:
    """The evaluation figure a sweep ranks its trials by (and ASHA's rungs compare): tune.metric, else
    train.best_metric."""
    return tune.metric or train.best_metric


def sweep_mode(tune: TuneSection, train: TrainSection) -> str:
    """tune.mode, else min for losses and perplexity, max for the other figures."""
    return tune.mode or ("min" if sweep_metric(tune, train) in LOWER_IS_BETTER else "max")

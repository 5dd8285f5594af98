"""The typed run config: one pydantic model of sections (app/config/sections.py), validated once, in the
driver, before Ray or any worker starts. Each section checks its own keys; the rules that relate several
sections (app/config/rules.py) run after them. Loading a file with `--set` overrides: app/config/loading.py.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import yaml
from pydantic import Field, model_validator

from app.config.adapters import AdapterSection
from app.config.distill import DistillSection
from app.config.dpo import DpoSection
from app.config.grpo import GrpoSection
from app.config.rollout import RolloutSection
from app.config.rules import RULES
from app.config.sections import (
    DataSection,
    EvalSection,
    FsdpSection,
    LoraSection,
    MlflowSection,
    ModelSection,
    ScalingSection,
    Section,
    TrainSection,
)
from app.config.tune import TuneSection
from app.runs.layout import OutputDir, RunDir


def entry_model(field) -> type[Section]:
    """The model of a config field: its section's, or for a list of entries (`adapters:`) each entry's."""
    args = typing.get_args(field.annotation)
    return args[0] if args else field.annotation


class FinetuneConfig(Section):
    model: ModelSection = ModelSection()
    lora: LoraSection = LoraSection()
    fsdp: FsdpSection = FsdpSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    scaling: ScalingSection = ScalingSection()
    mlflow: MlflowSection = MlflowSection()
    dpo: DpoSection = DpoSection()
    rollout: RolloutSection = RolloutSection()
    grpo: GrpoSection = GrpoSection()
    distill: DistillSection = DistillSection()
    tune: TuneSection = TuneSection()
    adapters: list[AdapterSection] = Field(default_factory=list, description=(
        "several named adapters trained side by side over one base (app/config/adapters.py); empty: one adapter "
        "from lora:"))

    @model_validator(mode="after")
    def _rules_hold(self) -> FinetuneConfig:
        for rule in RULES:
            sections = {name: getattr(self, name) for name in inspect.signature(rule).parameters}
            if problem := rule(**sections):
                raise ValueError(problem)
        return self

    @property
    def shard_group_size(self) -> int:
        """Ranks each parameter is split over in the run's smallest group (an elastic run's fewest workers, where
        each holds the most): what the planner and the NF4 shapes are checked for."""
        return self.scaling.mesh_shape(self.scaling.worker_counts[0])[-1]

    def with_set(self, values: dict[str, Any]) -> FinetuneConfig:
        """A new config with `values` ({"train.learning_rate": 1e-3, ...}) set and validated again, every rule
        included (a ValidationError names the first problem): the one way a config is derived from another, which
        stays as it is."""
        tree = self.model_dump(exclude_unset=True)
        for dotted, value in values.items():
            section, _, key = dotted.partition(".")
            if key:
                tree.setdefault(section, {})[key] = value
            else:  # a list of entries (adapters), set whole
                tree[section] = value
        return type(self).model_validate(tree)

    def adapter_alone(self, adapter: AdapterSection) -> FinetuneConfig:
        """The config `adapter` of adapters: would train with alone: its export's and its nested run's."""
        return self.with_set(adapter.alone_values(self.data))

    def trained_lora(self) -> LoraSection | dict[str, LoraSection]:
        """The adapter the run trains (lora:), or its adapters by name (adapters:)."""
        return {adapter.name: adapter.lora_of(self.lora) for adapter in self.adapters} if self.adapters else self.lora

    @property
    def output(self) -> OutputDir:
        return OutputDir(self.train.output_dir)

    @property
    def run_dir(self) -> RunDir:
        return self.output.run(str(self.train.run_name))

    def to_yaml(self) -> str:
        """The resolved config, loadable again with `--config`."""
        return yaml.safe_dump(self.model_dump(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """`{"lora.r": 16, ..., "adapters.a.r": 4}`: the shape MLflow params take."""
        flat = {f"{section}.{key}": value for section, fields in self.model_dump(exclude={"adapters"}).items()
                for key, value in fields.items()}
        return flat | {f"adapters.{adapter.name}.{key}": value for adapter in self.adapters
                       for key, value in adapter.model_dump(exclude={"name"}, exclude_none=True).items()}

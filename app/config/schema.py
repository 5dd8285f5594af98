"""The typed run config: one pydantic model of sections (app/config/sections.py), validated once, in the
driver, before Ray or any worker starts. Each section checks its own keys; the rules that relate several
sections (app/config/rules.py) run after them. Loading a file with `--set` overrides: app/config/loading.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import yaml
from pydantic import model_validator

from app.config.dpo import DpoSection
from app.config.grpo import GrpoSection
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
    grpo: GrpoSection = GrpoSection()
    tune: TuneSection = TuneSection()

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
            section, key = dotted.split(".")
            tree.setdefault(section, {})[key] = value
        return type(self).model_validate(tree)

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
        """`{"lora.r": 16, ...}`: the shape MLflow params take."""
        return {f"{section}.{key}": value for section, fields in self.model_dump().items()
                for key, value in fields.items()}

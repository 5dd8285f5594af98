"""A sweep's trials as configs: each key of `tune.space` checked against the config before the first trial starts
(the key exists, and the run is valid at each choice and at both ends of each range), and a trial's config
made from the sampled values. Plain functions: app/launch/tune_sweep.py hands them Ray Tune's samples."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from app.config.schema import FinetuneConfig
from app.errors import UserInputError

NOT_SWEPT = ("train.run_name", "train.output_dir", "mlflow.tracking_uri", "mlflow.experiment", "mlflow.sweep",
             "mlflow.parent_run_id")


def with_values(cfg: FinetuneConfig, values: dict[str, Any], source: str = "tune.space") -> FinetuneConfig:
    """The config with `values` ({"train.learning_rate": 1e-3, ...}) set and validated again, rules included."""
    tree = cfg.model_dump()
    for dotted in values:
        section, _, key = dotted.partition(".")
        if section not in tree or key not in tree[section] or section == "tune" or dotted in NOT_SWEPT:
            raise UserInputError(f"{source}: {dotted} is not a config key a trial can set"
                                 f"{' (the sweep sets it)' if dotted in NOT_SWEPT else ''}")
    try:
        return cfg.with_set(values)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        reason = first["msg"].removeprefix("Value error, ")
        raise UserInputError(f"{source}: {where + ': ' if where else ''}{reason}") from None


def check_space(cfg: FinetuneConfig) -> None:
    """Every value a trial may take makes a valid run, checked one key at a time at each choice and at both
    ends of each range (the ranges' insides are valid wherever their ends are, for the range checks the config
    makes); the first problem is one line naming the key and value."""
    if not cfg.tune.space:
        raise UserInputError("tune.space is empty: give at least one key to search, e.g. "
                             "--space 'train.learning_rate=loguniform(1e-4,3e-3)'")
    for key, dimension in cfg.tune.dimensions().items():
        for value in dimension.extremes():
            with_values(cfg, {key: value}, source=f"tune.space {key}={cfg.tune.space[key]} at {value!r}")

"""Sweeps: a grid of config overrides, one job per point, compared side by side from MLflow.

Plain functions (no Ray): `jobs/submit.py` submits the jobs; this module expands the grid, names
the runs, and builds the comparison table from the runs MLflow recorded.
"""

from __future__ import annotations

import itertools
import math

import yaml

from app.config.objectives import LOWER_IS_BETTER
from app.errors import UserInputError

SWEEP_METRICS = ("final_eval_loss", "final_train_loss", "tokens_per_second_steady", "worker_seconds")


def parse_grid(axes: list[str]) -> dict[str, list]:
    """["train.learning_rate=1e-3,3e-3", "lora.r=4,8"] -> {"train.learning_rate": [0.001, 0.003], ...}."""
    grid: dict[str, list] = {}
    for axis in axes:
        key, sep, raw = axis.partition("=")
        values = [yaml.safe_load(v) for v in raw.split(",") if v.strip()]
        if not sep or not values:
            raise UserInputError(f"--grid {axis}: expected key=v1,v2,..., e.g. --grid train.learning_rate=1e-3,3e-3")
        if key in grid:
            raise UserInputError(f"--grid {key}: given twice; list all its values in one --grid")
        grid[key.strip()] = values
    if not grid:
        raise UserInputError("sweep: give at least one --grid key=v1,v2")
    return grid


def grid_points(grid: dict[str, list]) -> list[dict[str, object]]:
    """Every combination of the grid's values, in a stable order."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def point_overrides(point: dict[str, object]) -> list[str]:
    return [f"{key}={value}" for key, value in point.items()]


def point_name(sweep: str, index: int, point: dict[str, object]) -> str:
    """A run name that says which point it is: `lr-sweep-1-learning_rate=0.003-r=8`."""
    parts = [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in point.items()]
    return "-".join([sweep, str(index), *parts]).replace("/", "_").replace(" ", "")


def results_table(runs: list[dict], grid_keys: list[str], best_metric: str) -> dict[str, list]:
    """Columns for MLflow's log_table and for printing: one row per run, the best by the runs' train.best_metric
    (its final value: lower first for a loss, higher first for the rest) first, runs without it last.

    `runs`: {"run_name", "status", "params": {...}, "metrics": {...}} per run.
    """
    ranked = f"final_{best_metric}"
    sign = 1.0 if best_metric in LOWER_IS_BETTER else -1.0

    def rank(run: dict) -> float:
        value = run["metrics"].get(ranked)
        return sign * value if value is not None and not math.isnan(value) else math.inf

    metrics = (ranked, *(m for m in SWEEP_METRICS if m != ranked))
    columns: dict[str, list] = {"run": [], "status": [], **{k: [] for k in grid_keys}, **{m: [] for m in metrics}}
    for run in sorted(runs, key=rank):
        columns["run"].append(run["run_name"])
        columns["status"].append(run["status"])
        for key in grid_keys:
            columns[key].append(run["params"].get(key))
        for metric in metrics:
            columns[metric].append(run["metrics"].get(metric))
    return columns


def format_table(columns: dict[str, list]) -> str:
    """A plain-text table with aligned columns; numbers to 4 significant digits."""
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    header = list(columns)
    rows = [[cell(v) for v in row] for row in zip(*columns.values())]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)

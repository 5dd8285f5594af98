"""Task metrics: how often the model's greedy answers to held-out prompts are right.

Each evaluation decodes up to `eval.generation_rows` eval prompts (app/train/generation.py: each assistant
turn of a conversation is one, its reference that turn's answer) and scores each generation against its
reference with every metric in `eval.metrics`: `exact_match`, `contains`, or a
user function named `module:function` taking (prediction, reference) and returning a float. The mean
over the rows is logged as `eval_<name>` (a user function: `eval_<function>`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from app.config.sections import BUILTIN_METRICS, metric_name
from app.errors import UserInputError

MetricFn = Callable[[str, str], float]


def _normalized(text: str) -> str:
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    """1 when the texts are equal up to whitespace."""
    return float(_normalized(prediction) == _normalized(reference))


def contains(prediction: str, reference: str) -> float:
    """1 when the reference appears in the prediction (up to whitespace): answers with extra words count."""
    return float(_normalized(reference) in _normalized(prediction))


BUILTIN: dict[str, MetricFn] = dict(zip(BUILTIN_METRICS, (exact_match, contains), strict=True))


def resolve(spec: str) -> MetricFn:
    """The scoring function of a spec; a user function is imported (from the job's working directory
    under `ray job submit`)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        raise UserInputError(f"eval.metrics: cannot import {spec} ({type(e).__name__}: {e}); name a function "
                             "`module:function` importable from the job's working directory, or use "
                             f"{' or '.join(BUILTIN)}") from None
    if not callable(function):
        raise UserInputError(f"eval.metrics: {spec} is not a function")
    return function


def row_scores(predictions: list[str], references: list[str], specs: list[str]) -> dict[str, list[float]]:
    """Each metric's score of every row, keyed by the spec's short name (a column of the sample table)."""
    return {metric_name(spec).removeprefix("eval_"): [float(fn(p, r)) for p, r in zip(predictions, references)]
            for spec, fn in ((spec, resolve(spec)) for spec in specs)}


def score(predictions: list[str], references: list[str], specs: list[str]) -> dict[str, float]:
    """Mean score of each metric over the rows, keyed by its MLflow metric name."""
    if not predictions:
        return {}
    return {f"eval_{name}": sum(values) / len(values)
            for name, values in row_scores(predictions, references, specs).items()}

"""Reward functions: the user's Python, with TRL's signature, so that a reward file written for TRL's
GRPOTrainer runs unchanged.

A function is named `path/to/file.py:function` (imported from that file) or `package.module:function` (from
the path), and called once per batch of answers as

    f(prompts=[...], completions=[...], completion_ids=[[...]], **columns) -> list[float | None]

with one entry per answer: the prompt as the record gave it (a string or messages), the answer (a string for
a plain prompt, [{"role": "assistant", "content": ...}] for a conversational one), its token ids, and every
other field of the record as a list (`answer=[...]`). None means "does not apply to this answer": it is left
out of that function's mean and counts 0 in the weighted sum. Anything else wrong (an import that fails, a
missing name, a call that raises, a list of the wrong length, a NaN) is a RewardError naming the function and
the record.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from app.errors import UserInputError, first_line

RewardFn = Callable[..., list]


class RewardError(UserInputError):
    """A reward function that cannot be imported or called, or gives what is not a reward: one line naming
    the function (and the record)."""


def in_working_directory(path: Path) -> Path:
    """A relative reward file where a job's process finds it: here, or in the job's uploaded working directory,
    which Ray puts on every worker's sys.path (Ray Train's workers run in a storage folder of their own)."""
    if path.is_absolute() or path.is_file():
        return path
    return next((Path(entry) / path for entry in sys.path if entry and (Path(entry) / path).is_file()), path)


@functools.cache
def load_reward_function(spec: str) -> RewardFn:
    """The function a `file.py:name` or `module:name` spec names (imported once per process)."""
    where, _, name = spec.rpartition(":")
    key = f"grpo.reward_funcs: {spec}"
    try:
        if where.endswith(".py"):
            path = in_working_directory(Path(where))
            if not path.is_file():
                raise RewardError(f"{key}: no such file {path} (a path absolute or relative to the job's working "
                                  "directory)")
            module_spec = importlib.util.spec_from_file_location(f"rewards_{path.stem}_{abs(hash(where))}", path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module  # dataclasses, pickling and relative lookups find it
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardError:
        raise
    except Exception as e:  # a syntax error, a failing import inside the file, ...
        raise RewardError(f"{key}: cannot import it ({type(e).__name__}: {first_line(e, 200)})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"{key}: {where} has no function {name!r}")
    return function


def call_reward(spec: str, prompts: list, completions: list, completion_ids: list[list[int]],
                columns: dict[str, list], first_record: int = 0) -> np.ndarray:
    """One reward function's rewards for a batch of answers, NaN where it returned None. `first_record`
    numbers the batch's first answer in messages."""
    function = load_reward_function(spec)
    try:
        rewards = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as e:
        raise RewardError(f"grpo.reward_funcs: {spec} raised {type(e).__name__} ({first_line(e, 200)}) on records "
                          f"{first_record}-{first_record + len(prompts) - 1}") from None
    if not isinstance(rewards, (list, tuple, np.ndarray)) or len(rewards) != len(prompts):
        got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple, np.ndarray)) else type(rewards).__name__
        raise RewardError(f"grpo.reward_funcs: {spec} returned {got} for {len(prompts)} answers; return one "
                          "float (or None) per answer")
    values = np.full(len(rewards), np.nan)
    for i, reward in enumerate(rewards):
        if reward is None:
            continue
        try:
            values[i] = float(reward)
        except (TypeError, ValueError):
            raise RewardError(f"grpo.reward_funcs: {spec} returned {reward!r} for record {first_record + i}; return "
                              "a float, or None where it does not apply") from None
        if not math.isfinite(values[i]):
            raise RewardError(f"grpo.reward_funcs: {spec} returned {reward} for record {first_record + i}; return a "
                              "finite float, or None where it does not apply")
    return values


def score(specs: list[str], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], first_record: int = 0) -> np.ndarray:
    """[answers, functions]: each function's reward of each answer (NaN: did not apply)."""
    if not specs:
        return np.zeros((len(prompts), 0))
    return np.stack([call_reward(spec, prompts, completions, completion_ids, columns, first_record)
                     for spec in specs], axis=1)


def combined(per_function: np.ndarray, weights: list[float]) -> np.ndarray:
    """The reward of each answer: the weighted sum of its functions' rewards, a NaN counting 0; NaN where no
    function applied (that answer then has no advantage)."""
    total = np.nansum(per_function * np.asarray(weights)[None, :], axis=1)
    total[np.isnan(per_function).all(axis=1)] = np.nan
    return total

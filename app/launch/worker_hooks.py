"""One point where a run's workers call code of the caller's choosing, off unless asked for: the resilience
tests inject their faults through it (tests/faults.py), and nothing else in a run does.

$FINETUNE_WORKER_HOOKS names a module the workers can import (e.g. `tests.faults`); the driver forwards it
to them, with every $FINETUNE_WORKER_HOOKS_* variable (the module's own settings). The module may define:

    step_pacing() -> Callable[[int], None] | None
        the recipe's `pace`, called with each step before it is taken
    checkpoint_written(step: int, is_last_rank: bool) -> None
        called on every rank once its part of a checkpoint is written, before Ray Train has it
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

HOOKS_ENV = "FINETUNE_WORKER_HOOKS"


def forwarded() -> dict[str, str]:
    """The hooks module and its settings in the driver's environment, for the workers' environment."""
    return {name: value for name, value in os.environ.items()
            if name == HOOKS_ENV or name.startswith(f"{HOOKS_ENV}_")}


def _hook(name: str) -> Callable | None:
    module = os.environ.get(HOOKS_ENV)
    return getattr(importlib.import_module(module), name, None) if module else None


def step_pacing() -> Callable[[int], None] | None:
    hook = _hook("step_pacing")
    return hook() if hook else None


def checkpoint_written(step: int, is_last_rank: bool) -> None:
    hook = _hook("checkpoint_written")
    if hook:
        hook(step, is_last_rank)

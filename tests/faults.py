"""Faults the resilience tests inject into a real job: a worker hooks module (app/launch/worker_hooks.py) that
the workers import when $FINETUNE_WORKER_HOOKS names it. Each fault acts only when its setting is in the
environment (`fault_env`); the driver forwards both to the workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from app.launch.worker_hooks import HOOKS_ENV

DIE_IN_CHECKPOINT = f"{HOOKS_ENV}_DIE_IN_CHECKPOINT"  # "STEP:MARKER": the last rank dies once mid-save at STEP
# "SECONDS[:STOP_FILE]": each step takes this much longer (until STOP_FILE exists): nodes come and go within a short run
STEP_SECONDS = f"{HOOKS_ENV}_STEP_SECONDS"


def fault_env(setting: str, value: str) -> dict[str, str]:
    """The environment that turns one fault on: this module as the workers' hooks, and the fault's setting."""
    return {HOOKS_ENV: __name__, setting: value}


def inject(monkeypatch, setting: str, value: str) -> None:
    """One fault on for the runs a test starts in its own process (its driver forwards it to the workers)."""
    for name, text in fault_env(setting, value).items():
        monkeypatch.setenv(name, text)


def step_pacing():
    """With STEP_SECONDS set, each step sleeps SECONDS more, until STOP_FILE exists (a test that has made its
    nodes come and go lets the rest of the run go at full speed); None without it."""
    seconds, _, stop_file = os.environ.get(STEP_SECONDS, "0").partition(":")
    if not float(seconds):
        return None

    def pace(step: int) -> None:
        if not (stop_file and os.path.exists(stop_file)):
            time.sleep(float(seconds))
    return pace


def checkpoint_written(step: int, is_last_rank: bool) -> None:
    """With DIE_IN_CHECKPOINT=STEP:MARKER set, the last rank SIGKILLs itself once, at that step, after writing
    its shard and before Ray has the checkpoint: a crash mid-save."""
    fault = os.environ.get(DIE_IN_CHECKPOINT)
    if not (fault and is_last_rank):
        return
    at_step, marker = fault.split(":", 1)
    if int(at_step) == step and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)

"""Faults the resilience tests inject into a real job, through the environment the driver forwards to its
workers. Nothing here acts unless a test sets these variables."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

DIE_IN_CHECKPOINT = "FINETUNE_FAULT_DIE_IN_CHECKPOINT"  # "STEP:MARKER": the last rank dies once mid-save at STEP
# "SECONDS[:STOP_FILE]": each step takes this much longer (until STOP_FILE exists): nodes come and go within a short run
STEP_SECONDS = "FINETUNE_FAULT_STEP_SECONDS"


def forwarded() -> dict[str, str]:
    """The fault settings of the driver's environment, for the workers' environment."""
    return {name: os.environ[name] for name in (DIE_IN_CHECKPOINT, STEP_SECONDS) if name in os.environ}


def step_pacing():
    """The recipe's `pace` hook with FINETUNE_FAULT_STEP_SECONDS set: each step sleeps SECONDS more, until
    STOP_FILE exists (a test that has made its nodes come and go lets the rest of the run go at full speed);
    None without it."""
    seconds, _, stop_file = os.environ.get(STEP_SECONDS, "0").partition(":")
    if not float(seconds):
        return None

    def pace(step: int) -> None:
        if not (stop_file and os.path.exists(stop_file)):
            time.sleep(float(seconds))
    return pace


def maybe_die_mid_save(step: int, is_last_rank: bool) -> None:
    """With FINETUNE_FAULT_DIE_IN_CHECKPOINT=STEP:MARKER set, the last rank SIGKILLs itself once, at that step,
    after writing its shard and before Ray has the checkpoint: a crash mid-save."""
    fault = os.environ.get(DIE_IN_CHECKPOINT)
    if not (fault and is_last_rank):
        return
    at_step, marker = fault.split(":", 1)
    if int(at_step) == step and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)

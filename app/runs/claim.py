"""The driver's hold on a run directory: one writer at a time, a new run never reusing a directory, a
resumed run finding its own.

The claim is taken before the MLflow run is created, so of two jobs started with one run name (two
`--resume X` at once, or two new runs racing) the second stops with one line and leaves nothing behind.
A claim whose process has ended (killed with SIGKILL, say) is taken over by the next job.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from app.config.schema import FinetuneConfig
from app.errors import UserInputError
from app.runs.layout import RunBusy


def this_process() -> dict:
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {}).get("job_submission_id")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time(),
            "ray_job": job, "since": time.strftime("%Y-%m-%dT%H:%M:%S")}


def claim_is_live(claim: dict) -> bool:
    """A claim made on this host is live while its process is; one from another host is assumed live
    (its owner cannot be checked from here)."""
    if claim.get("host") != socket.gethostname():
        return True
    try:
        return abs(psutil.Process(claim["pid"]).create_time() - claim["started"]) < 1.0
    except (psutil.NoSuchProcess, KeyError, TypeError):
        return False


@contextmanager
def claimed_run(cfg: FinetuneConfig, resume: bool):
    """Hold the run directory for this job; yields the MLflow run id to continue (None for a new run).

    The run is checked before the claim (a mistake writes nothing) and again once it is held (another
    job may have started the run meanwhile)."""
    run_dir, owner = cfg.run_dir, this_process()
    current = run_dir.writer()
    if current is not None and claim_is_live(current):
        raise _busy(cfg, current)
    _run_to_continue(cfg, resume)
    try:
        run_dir.claim(owner, claim_is_live)
    except RunBusy as busy:
        raise _busy(cfg, busy.claim) from None
    try:
        yield _run_to_continue(cfg, resume)
    finally:
        run_dir.release(owner)
        if run_dir.is_local and not any(Path(run_dir.root).iterdir()):
            Path(run_dir.root).rmdir()  # claimed, then stopped before anything was written


def _busy(cfg: FinetuneConfig, claim: dict) -> UserInputError:
    job = claim.get("ray_job") or f"pid {claim.get('pid')} on {claim.get('host')}"
    return UserInputError(f"train.run_name={cfg.train.run_name}: another job ({job}, since {claim.get('since')}) "
                          f"is writing {cfg.run_dir.root}; wait for it, or stop it (if it is gone without "
                          "ending, delete its writer.json there)")


def _run_to_continue(cfg: FinetuneConfig, resume: bool) -> str | None:
    run_dir = cfg.run_dir
    if not resume:
        if run_dir.has_record() or run_dir.checkpoints():
            raise UserInputError(f"train.run_name={cfg.train.run_name}: {run_dir.root} holds an earlier run; "
                                 "pass --resume to continue it, or choose another train.run_name")
        return None
    if not run_dir.has_record():
        raise UserInputError(f"--resume: no run to resume at {run_dir.root}; check train.run_name and "
                             "train.output_dir")
    if run_dir.adapter_complete():
        raise UserInputError(f"--resume: run {cfg.train.run_name} already finished ({run_dir.adapter} exists)")
    return run_dir.recorded_mlflow_run_id()

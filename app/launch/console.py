"""What a job prints: the progress line, real warnings and errors, and the JSON summary last.

Ray's own bookkeeping (start-up banners, Ray Data's execution plans, Ray Train's per-rank "Reporting
training result" and checkpoint lines, actor-constructor notices that Ray logs at error level, progress
bars of model loading) is hidden unless the job runs with `--verbose`. Levels are set through the
public knobs where there are some (the driver's loggers and ray.init's level, Ray Train's LoggingConfig,
Ray Data's and Hugging Face's environment variables for the workers); the lines that no level controls
are dropped by a filter on the driver, where Ray prints what the workers wrote.
"""

from __future__ import annotations

import logging
import os
import re
import sys

from app.logs import IMPORT_NOISE

# Lines that carry no information for the user of a job (each seen in a 2-worker run of the demo).
RAY_NOISE = re.compile("|".join([
    r"has constructor arguments in the object store and max_restarts > 0",  # ray issue 53727
    r"Progress bars disabled\. To enable",
    r"Starting execution of Dataset", r"Execution plan of Dataset", r"Dataset \S+ execution finished",
    r"Registered dataset logger for dataset",
    r"`ExecutionOptions\.exclude_resources` is deprecated",  # Ray Train's own use of Ray Data
    r"Started training worker group of size", r"- \(ip=\S+, pid=\d+\) world_rank=",
    r"Reporting training result \d+: TrainingReport",  # logged under a file-path logger name, no level applies
    IMPORT_NOISE.pattern,  # torchao's import-time lines (app/logs.py), written as a worker loads the training stack
]))
# Warnings Ray's own actors repeat on every poll (Ray Train's placement-group cleaner, once a node has left).
ONCE_PER_JOB = re.compile(r"Failed to query Ray Train Controller actor state|Failed to query placement group table")
# The workers' progress line (app/train/progress.py): printed as it is, without Ray's "(RayTrainWorker pid=...)".
PROGRESS_LINE = re.compile(r"^step \d+/\d+ \| loss ")
WORKER_ENV_QUIET = {"RAY_DATA_LOG_LEVEL": "WARNING", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                    "MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


QUIET_LOGGERS = {  # driver loggers and the level below which they are hidden
    "ray": logging.WARNING,
    "ray._private.authentication.authentication_token_setup": logging.ERROR,  # "token auth is enabled"
    "ray.data._internal.progress": logging.ERROR,  # "progress bars disabled"
    "mlflow": logging.WARNING,
}


def quiet_driver_logging() -> None:
    """Before Ray is imported: the driver's Ray, Ray Data and MLflow loggers show warnings and errors only
    (ray.init is then called with the same level: see ray_logging_level)."""
    for variable, value in WORKER_ENV_QUIET.items():
        os.environ.setdefault(variable, value)
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def ray_logging_level(verbose: bool) -> int:
    return logging.INFO if verbose else QUIET_LOGGERS["ray"]


def filter_worker_output() -> None:
    """After ray.init: drop known noise from the worker output Ray prints on the driver.

    Ray prints worker lines through one handler of its stream dispatcher (no public hook exists); this
    wraps that handler. A Python warning's second line (the source line) goes with its first. Progress
    lines go out bare; other worker lines keep Ray's prefix (which worker said it), without colour codes
    where the output is not a terminal (`ray job logs`, a file).
    """
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray version: print everything rather than fail
        return
    printers = [handler for name, handler in getattr(dispatcher, "handlers", []) if name == "ray_print_logs"]
    if not printers:
        return
    print_lines, sort_lines = printers[0], WorkerLines()

    def print_useful(data: dict) -> None:
        bare, kept = sort_lines(data.get("lines", []))
        for line in bare:
            print(line, file=sys.stderr if data.get("is_err") else sys.stdout, flush=True)
        if kept:
            print_lines({**data, "lines": kept})

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", print_useful)


class WorkerLines:
    """Sorts the lines workers wrote into (progress lines to print bare, lines to print with Ray's prefix);
    noise is dropped, and a warning that Ray repeats on every poll is kept once per job."""

    def __init__(self):
        self.seen_once: set[str] = set()

    def __call__(self, lines: list[str]) -> tuple[list[str], list[str]]:
        bare, kept, drop_next_indented = [], [], False
        for line in lines:
            if drop_next_indented and line.startswith(" "):
                drop_next_indented = False
                continue
            repeated = ONCE_PER_JOB.search(line)
            drop_next_indented = bool(RAY_NOISE.search(line)) or bool(repeated and repeated[0] in self.seen_once)
            if repeated:
                self.seen_once.add(repeated[0])
            if PROGRESS_LINE.match(line):
                bare.append(line)
            elif not drop_next_indented:
                kept.append(line)
        return bare, kept


def worker_env(verbose: bool) -> dict[str, str]:
    """Environment of the training workers: quiet unless verbose."""
    return {} if verbose else dict(WORKER_ENV_QUIET)

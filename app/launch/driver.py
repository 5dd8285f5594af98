"""The driver side of a run: check inputs, join or start Ray, build the datasets and the TorchTrainer.

Order matters: everything a user can get wrong is checked before any worker starts (while Ray starts), so
a typo costs seconds, not a worker group's start.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from app.config.paths import export_tracking_credentials, in_ray_job, ray_job_id, shared_storage
from app.config.schema import FinetuneConfig
from app.data.passes import source_names
from app.errors import UserInputError, first_line
from app.launch import console
from app.launch.summary import best_tags, job_summary
from app.launch.worker import FAULT_ENV, PACE_ENV, WorkerLaunch, train_worker
from app.runs.claim import check_run_dir, claimed_run
from app.runs.layout import is_uri
from app.train.progress import StartupClock

# Imported where they are used, so that Ray starts before they load (importing this module takes Ray and the
# config alone): the model stack (torch, transformers, PEFT) by the checks, while Ray starts; Ray Train, Ray
# Data and MLflow by the steps that run beside the worker group's start.
if TYPE_CHECKING:
    from ray.train.torch import TorchTrainer

    from app.data.pipeline import TrainData
    from app.launch.inputs import CheckedInputs, CheckedSources


def joins_a_cluster() -> bool:
    """True under `ray job submit` or with RAY_ADDRESS set: then we join that cluster."""
    return bool(os.environ.get("RAY_ADDRESS")) or in_ray_job()


def init_ray(verbose: bool = False) -> bool:
    """Join the running cluster, or start a local, single-process-tree one sized to this machine; whether this
    call connected (a process already connected, as a test session is, keeps its cluster).

    The local cluster declares two logical CPUs more than the cores it runs on: the training
    workers hold one each, and Ray Data's read and tokenize tasks need room beside them.
    """
    if ray.is_initialized():
        return False
    level = console.ray_logging_level(verbose)
    if joins_a_cluster():
        ray.init(logging_level=level)
    else:  # "local": never join a `ray start` cluster by accident; the dashboard binds to 127.0.0.1
        with state_api_address_pinned() as port:
            ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 2, logging_level=level, dashboard_port=port)
    if not verbose:
        console.filter_worker_output()
    if threading.current_thread() is threading.main_thread():
        # Connecting put Ray core's C++ failure handler in front of ray.init's SIGTERM handler: it prints a
        # stack dump into the job log when `ray job stop` sends SIGTERM. Its Python handler alone stays.
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
    return True


def free_local_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def state_api_address_pinned():
    """Yields a free port for the local cluster's dashboard, named in RAY_API_SERVER_ADDRESS while Ray starts
    (the `ray.init` inside the block), so that every Ray process inherits it, and this process not beyond
    the block (a Jobs API client here would follow it). Ray Train's PlacementGroupCleaner asks the state API
    whether the controller lives; with no address given it looks for a cluster, and where several run on
    the machine (two jobs, a `cluster/local-up.sh` stack) it prints a traceback every few seconds instead."""
    port, before = free_local_port(), os.environ.get("RAY_API_SERVER_ADDRESS")
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    try:
        yield port
    finally:
        if before is None:
            del os.environ["RAY_API_SERVER_ADDRESS"]
        else:
            os.environ["RAY_API_SERVER_ADDRESS"] = before


def check_placement(cfg: FinetuneConfig) -> None:
    """The cluster must hold every worker at once (gang scheduling), or an elastic run's fewest: say so
    before waiting forever. On a cluster of several hosts (the driver's among them; workers may land on
    any, and restart on another) the run's files must be where every host reads them."""
    have = ray.cluster_resources()
    workers = cfg.scaling.worker_counts[0]
    key = "scaling.min_workers" if cfg.scaling.elastic else "scaling.num_workers"
    need_cpu = workers * cfg.scaling.cpus_per_worker
    if need_cpu > have.get("CPU", 0):
        raise UserInputError(
            f"{key}={workers} needs {need_cpu:g} CPUs ({cfg.scaling.cpus_per_worker:g} per worker) but the "
            f"cluster has {have.get('CPU', 0):g}; lower {key} or scaling.cpus_per_worker, or add nodes")
    if cfg.scaling.use_gpu and workers > have.get("GPU", 0):
        raise UserInputError(
            f"{key}={workers} with scaling.use_gpu=true needs {workers} GPUs but the cluster has "
            f"{have.get('GPU', 0):g}; lower {key}, or set scaling.use_gpu=false to train on CPUs")
    hosts = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}  # nodes of one host: one
    if len(hosts) > 1 and not output_reaches_every_host(cfg):
        raise UserInputError(
            f"train.output_dir={cfg.train.output_dir} is a local path and this cluster spans {len(hosts)} hosts "
            f"({', '.join(sorted(hosts)[:4])}): the driver, the workers and a restarted worker could not read "
            "each other's run files and checkpoints; use a URI (s3://...), a path under $FINETUNE_STORAGE, or "
            "set train.shared_output_dir=true if every host mounts it")


def output_reaches_every_host(cfg: FinetuneConfig) -> bool:
    output, storage = cfg.train.output_dir, shared_storage()
    if is_uri(output) and not output.startswith("file://"):  # a bucket; file:// is this host's disk
        return True
    local = Path(output.removeprefix("file://")).resolve()
    return cfg.train.shared_output_dir or bool(storage and local.is_relative_to(Path(storage).resolve()))


def run_tags(cfg: FinetuneConfig) -> dict[str, str | None]:
    from app.tracking import mlflow_run as tracking

    return {
        "mlflow.user": getpass.getuser(),  # the UI's "Created by" and "Source"
        "mlflow.source.name": "jobs.finetune",
        "mlflow.source.type": "JOB" if in_ray_job() else "LOCAL",
        "base_model": cfg.model.path,
        "base_model_revision": cfg.model.revision,
        "mlflow.source.git.commit": os.environ.get("GIT_COMMIT") or tracking.git_commit(),
        "ray.job_submission_id": ray_job_id(),
        "ray.job_id": ray.get_runtime_context().get_job_id() if ray.is_initialized() else None,
        "data.train_path": ", ".join(cfg.data.train_paths),
    }


def build_data(cfg: FinetuneConfig, inputs: CheckedInputs) -> tuple[TrainData, dict, dict[str, float]]:
    """Token rows of every train source, the eval rows, and what was dropped: rows that truncation to
    data.max_seq_len left without a target token are not trained on (a NaN-loss step otherwise)."""
    from app.data.pipeline import build_eval_rows, build_train_data, read_records

    ray.data.DataContext.get_current().enable_progress_bars = False  # the job log keeps our progress line
    train, held_out = build_train_data(inputs.train, inputs.train_rows, inputs.tokenizer, cfg.model, cfg.data,
                                       cfg.train.seed, None if inputs.eval else cfg.data.eval_fraction,
                                       cfg.scaling.num_workers)
    eval_sources = [read_records(inputs.eval, cfg.data)] if inputs.eval else held_out
    eval_rows, eval_dropped = build_eval_rows(eval_sources, inputs.tokenizer, cfg.data)
    if train.dropped_rows or eval_dropped:
        print(f"warning: {train.dropped_rows} train and {eval_dropped} eval records have no target token left "
              f"after truncation to data.max_seq_len={cfg.data.max_seq_len}; they are left out",
              file=sys.stderr, flush=True)
    if train.malformed_rows:
        print(f"warning: {train.malformed_rows} train records lack the fields data.format={cfg.data.format} needs; "
              "they are left out", file=sys.stderr, flush=True)
    stats = {"data_train_rows_without_target": train.dropped_rows, "data_eval_rows_without_target": eval_dropped,
             "data_train_records_malformed": train.malformed_rows}
    if cfg.train.objective == "dpo":
        stats["data_train_pair_tokens_truncated"] = train.truncated_tokens
    stats |= {f"data_pass_rows/{name}": rows for name, rows in zip(train.plan.names, train.plan.rows_per_pass())}
    return train, eval_rows, stats


def in_background(name: str, fn, *args, on_error=None) -> Future:
    """`fn(*args)` in a daemon thread of the driver: its result, or what it raised, in the Future, which is
    set before `on_error(exception)` tells anyone else (the main thread then finds it done); a failure of
    `on_error` itself prints nothing (no traceback from a thread after the job's own one-line error)."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # raised in the driver's main thread, by whoever asks for the result
            done.set_exception(e)
            if on_error is not None:
                try:
                    on_error(e)
                except Exception:  # the job is ending already (Ray shut down): the main thread raises the reason
                    pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def prepare_data(cfg: FinetuneConfig, inputs: CheckedInputs, passes, run_id: str, startup: StartupClock) -> TrainData:
    """The token rows built and loaded into the pass coordinator, their figures logged. Returns the rows, which
    the driver holds until the run ends (the coordinator reads their blocks in place)."""
    from app.data.coordinator import load_passes
    from app.tracking import mlflow_run as tracking

    train, eval_rows, data_stats = build_data(cfg, inputs)
    pass_figures = load_passes(passes, train, eval_rows)
    startup.reached("data_ready")
    tracking.log_driver_metrics(cfg.mlflow.tracking_uri, run_id, data_stats | pass_figures | startup.seconds)
    return train


def data_fits_beside_workers(cfg: FinetuneConfig) -> bool:
    """Whether the driver's Ray Data tasks (read, tokenize) find a CPU with every training worker placed:
    then the worker group starts while the data is built, else after (the workers would hold every CPU
    the data needs while they wait for it)."""
    return ray.available_resources().get("CPU", 0) >= cfg.scaling.num_workers * cfg.scaling.cpus_per_worker + 1


def start_data(cfg: FinetuneConfig, inputs: CheckedInputs, passes, run_id: str, startup: StartupClock) -> Future:
    """The data, built in a thread beside the worker group's start where the cluster has CPUs to spare
    for it; otherwise built here first (its errors raised before any worker starts). On failure the
    coordinator is told why (ranks waiting for their first pass get the reason)."""
    tell_ranks = lambda e: passes.fail.remote(first_line(e))
    if data_fits_beside_workers(cfg):  # asked before the data's tasks take CPUs
        return in_background("data", prepare_data, cfg, inputs, passes, run_id, startup, on_error=tell_ranks)
    built: Future = Future()
    try:
        built.set_result(prepare_data(cfg, inputs, passes, run_id, startup))
    except BaseException as e:
        tell_ranks(e)
        raise
    return built


def train_on_workers(trainer: TorchTrainer, data: Future) -> dict:
    """The worker group trains (Ray Train's result: the final checkpoint's metrics); when the workers stopped
    because the driver could not build the data (they end without an error of their own), that reason is
    raised instead."""
    try:
        metrics = trainer.fit().metrics
    except Exception:
        raise_data_failure(data)
        raise
    raise_data_failure(data)
    return metrics


def raise_data_failure(data: Future) -> None:
    if data.done() and data.exception() is not None:
        raise data.exception() from None


def build_trainer(cfg: FinetuneConfig, inputs: CheckedInputs, passes, run_id: str, job_start_time: float,
                  verbose: bool = False) -> TorchTrainer:
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from app.model.sharding import process_group_backend
    from app.train import host_memory

    credentials = {k: os.environ[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
                   if k in os.environ}
    launch = WorkerLaunch(cfg, run_id, job_start_time, passes, source_names([s.location for s in inputs.train]),
                          credentials, ray.put(inputs.init_adapter) if inputs.init_adapter is not None else None)
    resources = {"CPU": cfg.scaling.cpus_per_worker} | ({"GPU": 1} if cfg.scaling.use_gpu else {})
    fault_injection = {name: os.environ[name] for name in (FAULT_ENV, PACE_ENV) if name in os.environ}
    return TorchTrainer(
        functools.partial(train_worker, launch),
        scaling_config=ScalingConfig(
            num_workers=(cfg.scaling.min_workers, cfg.scaling.num_workers) if cfg.scaling.elastic
            else cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu, resources_per_worker=resources,
            placement_strategy=cfg.scaling.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_seconds),
        run_config=RunConfig(  # the same name + storage path is what lets a relaunch resume
            name=cfg.train.run_name, storage_path=cfg.train.output_dir,
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            worker_runtime_env={"env_vars": console.worker_env(verbose) | fault_injection |
                                host_memory.worker_env(cfg.scaling.use_gpu, cfg.scaling.cpus_per_worker)},
            logging_config=LoggingConfig(log_level="INFO" if verbose else "WARNING")),
        torch_config=TorchConfig(backend=process_group_backend(cfg.scaling.use_gpu, cfg.fsdp.cpu_offload)),
    )


def log_model_quietly(cfg: FinetuneConfig, run_id: str, summary: dict) -> dict[str, str]:
    """The adapter as the run's MLflow Model (and a registered version): a failure warns, the adapter is
    on disk either way."""
    from app.tracking.registry import log_adapter_model

    try:
        return log_adapter_model(cfg, run_id, summary) or {}
    except Exception as e:
        print(f"warning: MLflow: the adapter was not logged as a model ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:200] if str(e) else ''}); it is at {cfg.run_dir.adapter}",
              file=sys.stderr, flush=True)
        return {}


def check_files(cfg: FinetuneConfig) -> tuple[FinetuneConfig, CheckedSources]:
    """Before Ray starts: the embedded demo built if the config reads it, a hub model pinned to its commit,
    what reads files alone (the model's directory, every data source and record: the commonest mistakes)."""
    from app.launch.inputs import check_sources, pin_hub_revision
    from app.model.embedded import ensure_embedded

    ensure_embedded(cfg)
    cfg = pin_hub_revision(cfg)
    return cfg, check_sources(cfg)


def check_model(cfg: FinetuneConfig, sources: CheckedSources,
                startup: StartupClock) -> tuple[FinetuneConfig, CheckedInputs]:
    """While Ray starts (mostly Ray's own processes; this is the model stack's imports and the checks that
    load it: app/launch/inputs.py); returns the config as the workers will read it, and every input."""
    from app.launch.inputs import check_model_inputs, with_loadable_model
    from app.tracking import mlflow_run  # noqa: F401  the driver's next step needs it: loaded here meanwhile

    inputs = check_model_inputs(cfg, sources)
    startup.reached("inputs_checked")
    return with_loadable_model(cfg), inputs


def open_mlflow_run(cfg: FinetuneConfig, inputs: CheckedInputs, run_to_continue: str | None) -> str:
    """A new MLflow run (recorded in the run directory), or the resumed one reopened."""
    from app.tracking import mlflow_run as tracking

    if run_to_continue is not None:
        tracking.reopen_run(cfg.mlflow.tracking_uri, run_to_continue, run_tags(cfg), cfg.model.revision)
        return run_to_continue
    run_id = tracking.start_run(cfg, run_tags(cfg), {"data.train_rows": sum(inputs.train_rows),
                                                    "data.eval_rows": inputs.eval_rows},
                                [("train", source) for source in inputs.train] + [("eval", inputs.eval)])
    cfg.run_dir.write_record(run_id)
    return run_id


def run_finetune(cfg: FinetuneConfig, resume: bool = False, verbose: bool = False,
                 started_at: float | None = None) -> dict:
    """Check, launch, train, record; returns the one-line JSON summary as a dict.

    With `resume`, continues the run of the same `train.run_name` from its latest checkpoint, in the
    same MLflow run, with whatever worker count the config now asks for. The summary comes from the
    workers through Ray Train: a tracking server that is down at the end costs a warning, not the run.
    `started_at`: when the job began (the command's process start: the timeline then counts the driver's
    imports too); now, if not given.

    What overlaps: the checks that load the model stack run while Ray starts (a local cluster this call
    starts is stopped again if they fail), and the data is built while Ray Train starts the worker group.
    Everything a user can get wrong is refused before any worker starts; what reads only files (the model's
    directory, the data, whether the run directory is free), before Ray starts.
    """
    t0, job_start_time = time.perf_counter(), started_at or time.time()
    export_tracking_credentials()  # the config holds the tracking URI without them
    startup = StartupClock(job_start_time)
    if started_at is not None:
        startup.reached("driver_ready")
    cfg, sources = check_files(cfg)
    check_run_dir(cfg, resume)
    checked = in_background("checks", check_model, cfg, sources, startup)
    started_ray = init_ray(verbose)
    startup.reached("ray_ready")
    try:
        cfg, inputs = checked.result()
    except BaseException:
        if started_ray:  # nothing of this job is left running
            ray.shutdown()
        raise
    check_placement(cfg)
    with claimed_run(cfg, resume) as run_to_continue:
        run_id = open_mlflow_run(cfg, inputs, run_to_continue)
        startup.reached("mlflow_run_ready")
        from app.data.coordinator import start_pass_coordinator
        from app.tracking import mlflow_run as tracking

        status = "FAILED"
        try:
            passes = start_pass_coordinator(cfg.scaling.num_workers, cfg.data)
            data = start_data(cfg, inputs, passes, run_id, startup)
            metrics = train_on_workers(build_trainer(cfg, inputs, passes, run_id, job_start_time, verbose), data)
            status = "FINISHED"
            tracking.set_tags(cfg.mlflow.tracking_uri, run_id, best_tags(cfg, metrics))
            model = log_model_quietly(cfg, run_id, metrics)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM from `ray job stop` (ray.init's handler exits)
            status = "KILLED"
            raise
        finally:
            mlflow_synced = tracking.finish_run(cfg.mlflow.tracking_uri, run_id, status, cfg.run_dir)
    return job_summary(cfg, run_id, metrics, startup, mlflow_synced, model, wall_seconds=time.perf_counter() - t0)

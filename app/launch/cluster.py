"""The Ray cluster a job runs on: joined under `ray job submit` (or with RAY_ADDRESS), else started locally,
sized to this machine; and whether it can hold the job's workers and reach its files."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
from pathlib import Path

import ray

from app.config.objectives import objective_of
from app.config.schema import FinetuneConfig
from app.environment import joins_a_cluster, shared_storage
from app.errors import UserInputError
from app.launch import console
from app.plan.rollout_sizing import rollout_gpus_each
from app.runs.layout import is_uri


def init_ray(verbose: bool = False, extra_cpus: float = 0.0) -> bool:
    """Join the running cluster, or start a local, single-process-tree one sized to this machine; whether this
    call connected (a process already connected, as a test session is, keeps its cluster).

    The local cluster declares two logical CPUs more than the cores it runs on (and `extra_cpus`: what GRPO's
    rollout actors reserve): the training workers hold one each, and Ray Data's read and tokenize tasks need
    room beside them.
    """
    if ray.is_initialized():
        return False
    level = console.ray_logging_level(verbose)
    if joins_a_cluster():
        ray.init(logging_level=level)
    else:  # "local": never join a `ray start` cluster by accident; the dashboard binds to 127.0.0.1
        with state_api_address_pinned() as port:
            ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 2 + math.ceil(extra_cpus), logging_level=level,
                     dashboard_port=port)
    if not verbose:
        console.filter_worker_output()
    if threading.current_thread() is threading.main_thread():
        # Connecting put Ray core's C++ failure handler in front of ray.init's SIGTERM handler: it prints a
        # stack dump into the job log when `ray job stop` sends SIGTERM. Its Python handler alone stays.
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
    return True


def free_local_port() -> int:
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
    rollout_cpus, rollout_gpus = rollout_resources(cfg)
    need_cpu = workers * cfg.scaling.cpus_per_worker + rollout_cpus
    beside = f" and {rollout_cpus:g} for rollout.workers" if rollout_cpus else ""
    if need_cpu > have.get("CPU", 0):
        raise UserInputError(
            f"{key}={workers} needs {workers * cfg.scaling.cpus_per_worker:g} CPUs ({cfg.scaling.cpus_per_worker:g} "
            f"per worker){beside} but the cluster has {have.get('CPU', 0):g}; lower {key} or "
            "scaling.cpus_per_worker, or add nodes")
    need_gpu = (workers if cfg.scaling.use_gpu else 0) + rollout_gpus
    if need_gpu > have.get("GPU", 0):
        raise UserInputError(
            f"{key}={workers} with scaling.use_gpu={str(cfg.scaling.use_gpu).lower()} needs {need_gpu:g} GPUs "
            f"(rollout.gpus included) but the cluster has {have.get('GPU', 0):g}; lower {key}, or set "
            "scaling.use_gpu=false to train on CPUs")
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


def rollout_resources(cfg: FinetuneConfig) -> tuple[float, float]:
    """(CPUs, GPUs) GRPO's rollout actors reserve beside the training workers; none for the other objectives (where
    their number is still `auto`, one actor's: a local cluster declares them before the driver sizes the group)."""
    if not objective_of(cfg.train).samples_online:
        return 0.0, 0.0
    actors = 1 if cfg.rollout.workers == "auto" else cfg.rollout.workers  # auto: 1 until the driver sizes it
    return actors * cfg.rollout.cpus, actors * rollout_gpus_each(cfg)


def data_fits_beside_workers(cfg: FinetuneConfig) -> bool:
    """Whether the driver's Ray Data tasks (read, tokenize) find a CPU with every training worker placed:
    then the worker group starts while the data is built, else after (the workers would hold every CPU
    the data needs while they wait for it). Asked once the rollout actors, if any, hold theirs."""
    return ray.available_resources().get("CPU", 0) >= cfg.scaling.num_workers * cfg.scaling.cpus_per_worker + 1

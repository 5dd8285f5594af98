"""The run's training data, built by the driver: every source read and tokenized once by Ray Data
(app/data/pipeline.py), the eval rows, and both handed to the pass coordinator (app/data/coordinator.py),
which builds each pass for the ranks; the same again for each distinct data of adapters' own (adapters:;
adapters with the same data share one). Built
beside the worker group's start where the cluster has a CPU to spare, else before it; either way a failure
reaches the ranks waiting for their first pass as one line."""

from __future__ import annotations

from concurrent.futures import Future

import ray

from app.config.objectives import objective_of
from app.config.sections import DataSection
from app.data.coordinator import load_passes, start_pass_coordinator
from app.data.passes import source_key
from app.data.pipeline import TrainData, build_eval_rows, build_train_data, read_records
from app.errors import UserInputError, first_line, warn
from app.launch.background import in_background
from app.launch.cluster import data_fits_beside_workers
from app.launch.inputs import CheckedSources
from app.launch.job import Job
from app.tracking import mlflow_run


def build_data(job: Job, data: DataSection, inputs: CheckedSources) -> tuple[TrainData, dict, dict[str, float]]:
    """Token rows of every train source of `data` (the job's, or an adapter's own), the eval rows, and what was
    dropped: rows that truncation to data.max_seq_len left without a target token are not trained on (a NaN-loss
    step otherwise)."""
    cfg, tokenizer = job.cfg, job.inputs.tokenizer
    ray.data.DataContext.get_current().enable_progress_bars = False  # the job log keeps our progress line
    train, held_out = build_train_data(inputs.train, inputs.train_rows, tokenizer, cfg.model, data,
                                       cfg.train.seed, None if inputs.eval else data.eval_fraction,
                                       cfg.scaling.num_workers)
    eval_sources = [read_records(inputs.eval, data)] if inputs.eval else held_out
    eval_rows, eval_dropped = build_eval_rows(eval_sources, tokenizer, data)
    if train.dropped_rows or eval_dropped:
        warn(f"{train.dropped_rows} train and {eval_dropped} eval records have no target token left after "
             f"truncation to data.max_seq_len={data.max_seq_len}; they are left out")
    if train.malformed_rows:
        warn(f"{train.malformed_rows} train records lack the fields data.format={data.format} needs, or the chat "
             "template refuses them; they are left out")
    stats = {"data_train_rows_without_target": train.dropped_rows, "data_eval_rows_without_target": eval_dropped,
             "data_train_records_malformed": train.malformed_rows}
    if objective_of(cfg.train).record_format == "preference":
        stats["data_train_pair_tokens_truncated"] = train.truncated_tokens
    stats |= {f"data_pass_rows/{source_key(name)}": rows
              for name, rows in zip(train.plan.names, train.plan.rows_per_pass())}
    return train, eval_rows, stats


def stream_data(job: Job, name: str) -> DataSection:
    """The data section of a stream: the job's ("") or that of the adapter the stream is named after."""
    return next(a.data_of(job.cfg.data) for a in job.cfg.adapters if a.name == name) if name else job.cfg.data


def prepare_data(job: Job, passes: dict[str, ray.actor.ActorHandle]) -> list[TrainData]:
    """The token rows built and loaded into the pass coordinators (the job's data's, "", and each one of adapters'
    own: app.config.adapters.data_streams), their figures logged (an adapter's data's under its name). Returns the
    rows, which the driver holds until the run ends (the coordinators read their blocks in place)."""
    built, figures = [], {}
    for name, coordinator in passes.items():
        inputs = job.inputs.adapters[name] if name else job.inputs
        try:
            train, eval_rows, data_stats = build_data(job, stream_data(job, name), inputs)
            pass_figures = load_passes(coordinator, train, eval_rows)
        except UserInputError as e:
            raise (UserInputError(f"adapters: {name}'s data: {e}") if name else e) from None
        built.append(train)
        figures |= {f"{name}/{key}" if name else key: value for key, value in (data_stats | pass_figures).items()}
    job.startup.reached("data_ready")
    mlflow_run.log_driver_metrics(job.cfg.mlflow.tracking_uri, job.run_id, figures | job.startup.seconds)
    return built


def start_data(job: Job) -> tuple[dict[str, ray.actor.ActorHandle], Future]:
    """The pass coordinators (the job's data's, "", and each one of adapters' own), created empty, and the
    data they are loaded with: built in a thread beside the worker group's start where the cluster has CPUs to
    spare for it; otherwise built here first (its errors raised before any worker starts). On failure every
    coordinator is told why (ranks waiting for their first pass get the reason)."""
    passes = {name: start_pass_coordinator(job.cfg.scaling.num_workers, stream_data(job, name))
              for name in ["", *job.inputs.adapters]}

    def tell_ranks(error: BaseException) -> None:
        for coordinator in passes.values():
            coordinator.fail.remote(first_line(error))

    if data_fits_beside_workers(job.cfg):  # asked before the data's tasks take CPUs
        return passes, in_background("data", prepare_data, job, passes, on_error=tell_ranks)
    built: Future = Future()
    try:
        built.set_result(prepare_data(job, passes))
    except BaseException as e:
        tell_ranks(e)
        raise
    return passes, built

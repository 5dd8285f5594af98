"""The rules that relate keys of several sections, one named function each.

A rule's parameters are named after the sections it reads (`train`, `scaling`, ...), so what it depends on is
in its signature; it returns the one-line problem, or None. FinetuneConfig applies them in the order of RULES
after each section has validated itself, and the first problem stops the load (app/config/loading.py turns
it into the job's one-line error).
"""

from __future__ import annotations

from app.config.sections import (
    RUN_NAME,
    DataSection,
    EvalSection,
    FsdpSection,
    LoraSection,
    ModelSection,
    ScalingSection,
    TrainSection,
    metric_name,
)


def min_workers_within_num_workers(scaling: ScalingSection) -> str | None:
    if scaling.min_workers is not None and scaling.min_workers > scaling.num_workers:
        return (f"scaling.min_workers={scaling.min_workers} is more than scaling.num_workers={scaling.num_workers}: "
                "lower it, or leave it unset for a fixed group")
    return None


def global_batch_splits_over_every_group(train: TrainSection, scaling: ScalingSection) -> str | None:
    """Every group size the run may train with takes whole micro-batches per rank per step."""
    for workers in scaling.worker_counts:
        per_step = train.micro_batch_size * workers
        if train.global_batch_size % per_step == 0:
            continue
        if workers == scaling.num_workers:
            return (f"train.global_batch_size={train.global_batch_size} must be a multiple of "
                    f"train.micro_batch_size x scaling.num_workers = {per_step}; change one of them")
        return (f"train.global_batch_size={train.global_batch_size} must be a multiple of train.micro_batch_size x "
                f"{workers} workers = {per_step} (an elastic group may shrink to scaling.min_workers="
                f"{scaling.min_workers}); change one of them")
    return None


def offload_needs_a_gpu(fsdp: FsdpSection, scaling: ScalingSection) -> str | None:
    if fsdp.cpu_offload and not scaling.use_gpu:
        return ("fsdp.cpu_offload=true moves GPU state to host memory; with scaling.use_gpu=false everything is in "
                "host memory already: set fsdp.cpu_offload=false")
    return None


def run_name_is_one_path_segment(train: TrainSection) -> str | None:
    name = train.run_name
    if name is not None and (not RUN_NAME.fullmatch(name) or ".." in name):
        return (f"train.run_name={name}: use letters, digits and . _ - = , + only, no '..' (it names a directory, "
                "an MLflow run and a Ray job)")
    return None


def no_float16_compute(fsdp: FsdpSection) -> str | None:
    if fsdp.param_dtype == "float16":
        return ("fsdp.param_dtype=float16 needs loss scaling, which this job does not do (small gradients underflow "
                "to zero): use bfloat16, float32 or auto")
    return None


def reported_figures(train: TrainSection, eval: EvalSection) -> set[str]:
    """The evaluation figures this config's runs report, that train.best_metric may rank by."""
    by_objective = {"sft": {"eval_loss", "eval_perplexity"},
                    "dpo": {"eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"}}
    tasks = {metric_name(spec) for spec in eval.metrics} if eval.generation_rows else set()
    return by_objective[train.objective] | tasks


def best_metric_is_reported(train: TrainSection, eval: EvalSection) -> str | None:
    ranked = reported_figures(train, eval)
    if train.best_metric not in ranked:
        return (f"train.best_metric={train.best_metric} is not an evaluation figure of this config: use one of "
                f"{', '.join(sorted(ranked))} (task metrics need eval.generation_rows > 0)")
    return None


def a_weight_per_source(data: DataSection) -> str | None:
    weights = data.mixture_weights
    if weights is not None and (len(weights) != len(data.train_paths) or min(weights) <= 0):
        return (f"data.mixture_weights={weights} must give one positive weight for each of the "
                f"{len(data.train_paths)} sources in data.train_path")
    return None


def data_feeds_the_objective(train: TrainSection, data: DataSection) -> str | None:
    """Preference pairs for dpo and nothing else; what dpo never does (pack, split) is not asked of it."""
    pairs = train.objective == "dpo"
    if pairs and data.format not in ("auto", "preference"):
        return (f"data.format={data.format} holds no preference pairs; train.objective=dpo reads "
                "data.format=preference (or auto): records with prompt, chosen and rejected")
    if not pairs and data.format == "preference":
        return "data.format=preference holds pairs to prefer one answer of: set train.objective=dpo"
    if pairs and data.packing and "packing" in data.model_fields_set:
        return ("data.packing=true: preference pairs are not packed (chosen and rejected go through one forward "
                "side by side); remove the key or set it false for train.objective=dpo")
    if pairs and data.long_records == "split" and "long_records" in data.model_fields_set:
        return ("data.long_records=split: a preference pair is truncated to data.max_seq_len (the prompt's end, "
                "the answers' starts), never split; remove the key for train.objective=dpo")
    return None


def nf4_without_dora_or_compile(model: ModelSection, lora: LoraSection) -> str | None:
    if model.quantization == "nf4" and (lora.use_dora or model.compile):
        key = "lora.use_dora" if lora.use_dora else "model.compile"
        return (f"{key}=true with model.quantization=nf4: not supported over a 4-bit base (DoRA needs the "
                "dequantized weight's row norms; compiled NF4 layers are untried); turn one of them off")
    return None


def mesh_covers_the_workers(scaling: ScalingSection) -> str | None:
    mesh = scaling.mesh
    if mesh is not None and (len(mesh) != 2 or mesh[0] * mesh[1] != scaling.num_workers or min(mesh) < 1):
        return (f"scaling.mesh={mesh} must be [replicas, shard size] with replicas x shard size = "
                f"scaling.num_workers = {scaling.num_workers}")
    if mesh is not None and scaling.elastic:
        return (f"scaling.mesh={mesh} with scaling.min_workers={scaling.min_workers}: an HSDP mesh is for a fixed "
                "worker count; unset one of them")
    return None


RULES = (min_workers_within_num_workers, global_batch_splits_over_every_group, offload_needs_a_gpu,
         run_name_is_one_path_segment, no_float16_compute, best_metric_is_reported, a_weight_per_source,
         data_feeds_the_objective, nf4_without_dora_or_compile, mesh_covers_the_workers)

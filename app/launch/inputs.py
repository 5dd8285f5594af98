"""Everything the driver checks before any worker starts, in two parts: what reads only files (the model's
directory, every data source and its records) before Ray starts, so that the commonest mistakes cost a
second; what loads the model stack (its tokenizer and chat template, the LoRA targets on a weightless copy,
whether packed rows keep its records apart, NF4 shapes, task metrics, model.init_adapter) while Ray starts.
Either way one line naming the key, file or line."""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

from app.config.paths import looks_local
from app.config.schema import FinetuneConfig, ModelSection
from app.data.sources import DataSource, check_source, resolve_source
from app.errors import UserInputError, first_line
from app.model.source import check_model_source


@dataclass(frozen=True)
class CheckedSources:
    train: list[DataSource]  # one per data.train_path source
    eval: DataSource | None
    train_rows: list[int]  # records of each train source (-1: remote, counted when read)
    eval_rows: int


@dataclass(frozen=True)
class CheckedInputs(CheckedSources):
    tokenizer: object
    init_adapter: dict | None = None  # model.init_adapter's weights (saved key -> tensor)


def check_sources(cfg: FinetuneConfig) -> CheckedSources:
    """What reads files alone (no torch, no transformers): the model's directory, the data sources and every
    local record."""
    check_model_source(cfg.model)
    train = [resolve_source(path, "data.train_path") for path in cfg.data.train_paths]
    eval_ = resolve_source(cfg.data.eval_path, "data.eval_path") if cfg.data.eval_path else None
    train_rows = [check_source(source, cfg.data.format, "data.train_path", cfg.data.split) for source in train]
    eval_rows = check_source(eval_, cfg.data.format, "data.eval_path", cfg.data.split) if eval_ else -1
    return CheckedSources(train, eval_, train_rows, eval_rows)


def check_model_inputs(cfg: FinetuneConfig, sources: CheckedSources) -> CheckedInputs:
    """What loads the model stack: the tokenizer and its chat template, the LoRA targets, NF4 shapes, packing,
    task metrics, model.init_adapter; with the sources, everything the workers are handed."""
    from app.data.formatting import check_chat_template
    from app.model.build import check_lora_targets, load_tokenizer
    from app.train import task_metrics

    try:
        tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserInputError(f"model.path={cfg.model.path}: cannot load its tokenizer: {first}") from None
    check_chat_template(tokenizer, "data.chat_template" if cfg.data.chat_template else f"model.path={cfg.model.path}")
    check_lora_targets(cfg.model, cfg.lora)
    if cfg.model.quantization == "nf4":
        check_nf4_shapes(cfg)
    if cfg.data.packing:
        check_packing(cfg.model)
    for spec in cfg.eval.metrics if cfg.eval.generation_rows else ():
        task_metrics.resolve(spec)  # a user function that does not import fails here, not in every worker
    return CheckedInputs(**vars(sources), tokenizer=tokenizer, init_adapter=read_init_adapter(cfg))


def read_init_adapter(cfg: FinetuneConfig) -> dict | None:
    """model.init_adapter found (a folder, a run under train.output_dir, a registered version), checked against
    the model this run builds, and its weights read: the driver ships them to the workers, which need not
    reach where it came from."""
    source = cfg.model.init_adapter
    if source is None:
        return None
    from app.model.init_adapter import check_init_adapter, read_adapter_weights
    from app.serve.models import Base, adapter_folder, base_of
    from app.tracking.mlflow_run import fluent_tracking_uri

    registry = fluent_tracking_uri(cfg.mlflow.tracking_uri) if source.startswith("models:/") else None
    try:
        with registry or contextlib.nullcontext():
            folder = adapter_folder(source, cfg.train.output_dir)
            trained_on = base_of(folder, source)
    except ValueError as e:  # neither a folder, a run nor a registered version: it says where it looked
        raise UserInputError(f"model.init_adapter={source}: {first_line(e).removeprefix(f'adapter {source}: ')}") \
            from None
    except Exception as e:  # a registry that does not answer or lacks the version
        raise UserInputError(f"model.init_adapter={source}: {first_line(e)}; give an adapter folder, a run name "
                             f"under train.output_dir={cfg.train.output_dir}, or models:/NAME/VERSION") from None
    check_init_adapter(source, folder, cfg.model, cfg.lora)
    if not trained_on.same_as(Base(cfg.model.path, cfg.model.revision)):
        print(f"warning: model.init_adapter={source} was trained on {trained_on}; this run's base is "
              f"{cfg.model.path} (the shapes agree)", file=sys.stderr, flush=True)
    return read_adapter_weights(folder)


def check_nf4_shapes(cfg: FinetuneConfig) -> None:
    """model.quantization=nf4 splits each quantized weight's rows over the ranks of a shard group in whole
    NF4 blocks: checked on a weightless copy of the model before any worker starts."""
    from app.model.quantization import quantization_problem
    from app.model.sharded_loading import build_meta_base_model
    from app.model.sharding import decoder_layers

    base = build_meta_base_model(cfg.model)
    groups = [cfg.shard_group_size] if cfg.scaling.mesh else cfg.scaling.worker_counts  # elastic: every size
    for shards in groups:
        if problem := quantization_problem(base, decoder_layers(base), shards):
            raise UserInputError(f"model.quantization=nf4: {problem}; use a number of workers (or scaling.mesh "
                                 "shard size, or scaling.min_workers) that divides it, or model.quantization=none")


def check_packing(model: ModelSection) -> None:
    """Packed rows must train each record as if it were alone: a tiny random copy of the model's architecture
    shows whether (and how) they do (app/model/packing_probe.py); where nothing keeps records apart, packing
    is refused here, before any worker starts."""
    from transformers import AutoConfig

    from app.model.packing_probe import packing_problem

    config = AutoConfig.from_pretrained(model.path, revision=model.revision, trust_remote_code=model.trust_remote_code)
    problem = packing_problem(config, model.attn_implementation, model.trust_remote_code)
    if problem:
        raise UserInputError(problem)


def with_loadable_model(cfg: FinetuneConfig) -> FinetuneConfig:
    """`model.load: sharded` reads each rank's slices of the checkpoint; where transformers must convert
    tensors to build a parameter (fused experts, ...), load the model whole instead, and say so."""
    if cfg.model.load != "sharded":
        return cfg
    from app.model.sharded_loading import sharded_loading_problem

    problem = sharded_loading_problem(cfg.model)
    if problem is None:
        return cfg
    print(f"warning: model.load=sharded: {problem}; every worker loads the whole model instead (model.load=full)",
          file=sys.stderr, flush=True)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"load": "full"})})


def pin_hub_revision(cfg: FinetuneConfig) -> FinetuneConfig:
    """A hub model's revision (a branch, a tag, or none: main) resolved to its commit here, in the driver:
    every worker then loads the same weights even if the branch moves during the run, the run is tagged
    with the commit, and a resume can check it still trains the same model."""
    path, revision = cfg.model.path, cfg.model.revision
    if looks_local(path) or "://" in path or (revision and re.fullmatch(r"[0-9a-f]{40}", revision)):
        return cfg
    from huggingface_hub import HfApi

    try:
        sha = HfApi().model_info(path, revision=revision).sha
    except Exception as e:  # no network, no such repo or revision, a gated repo without HF_TOKEN
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserInputError(f"model.path={path}: cannot resolve revision {revision or 'main'} on the hub "
                             f"({first}); check the id, HF_TOKEN, or give a local directory") from None
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"revision": sha})})

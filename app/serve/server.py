"""OpenAI-compatible chat and text completions on Ray Serve: one base model, any number of LoRA adapters.

The request's `model` picks the adapter; the base's own name answers without any. Adapters come from a local
folder, a run name under the output directory, or the MLflow Model Registry (`models:/NAME/VERSION`, or
`models:/NAME@ALIAS`: followed as the alias moves, app/serve/follow.py), resolved by the replica itself, so it
may run on any node that reaches the storage or the tracking server. The HTTP API is app/serve/api.py (keys,
limits, validation, streaming); behind it the engines the driver chose (app/serve/engines.py): this project's
engine (app/engine/, continuous batching over every adapter at once) and/or vLLM's (app/serve/vllm_engine.py).
This module is Ray's edge: the deployment, its limits and its health.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from ray import serve
from transformers import AutoConfig, GenerationConfig

from app.engine.sequence import end_token_ids
from app.model.hardware import has_fast_bf16, resolve_dtype
from app.model.merge import base_model_problem, merge_problem
from app.serve.api import Served, build_api, context_length, vocabulary_size
from app.serve.engine import TransformersEngine, in_model_dtype
from app.serve.engines import Choice, Engines
from app.serve.follow import AliasFollower
from app.serve.merged_engine import MergedAdapters
from app.serve.models import ServedFiles, load_model, load_tokenizer, served_files
from app.serve.vllm_engine import VllmEngine
from app.tracking.adapters import adapter_folder, base_of, pinned

log = logging.getLogger(__name__)
# Serve's defaults for a replica: concurrent requests and those queued beyond that (refused with 503 when full).
# jobs.serve sets both from its arguments.
LIMITS = {"max_ongoing_requests": 64, "max_queued_requests": 128}


def generation_config(files: ServedFiles) -> GenerationConfig | None:
    """The base's generation_config.json (its end-of-turn tokens), where it has one."""
    try:
        return GenerationConfig.from_pretrained(files.base, revision=files.revision)
    except OSError:
        return None


def start_engines(choice: Choice, files: ServedFiles, tokenizer, config, max_rows: int, cache_gb: float,
                  device: torch.device, threads: int | None = None, dtype: str = "auto",
                  eager: bool = False) -> Engines:
    """The engines `choice` names, one instance per kind (one serving both where it names one), computing in
    `dtype` (auto: bf16 where the hardware has it natively); `eager`: vLLM without compiling (a faster start).
    vLLM engines beside merged ones share `cache_gb` (one share kept for a followed alias's next version)."""
    dtype = resolve_dtype(dtype, has_fast_bf16(device))
    choice, started = mergeable(choice, files), {}
    if "transformers" in choice.engines:
        model = load_model(files, getattr(torch, dtype)).to(device)
        in_model_dtype(model)
        started["transformers"] = TransformersEngine(model, tokenizer, max_rows, cache_gb=cache_gb)
    ends, context = end_token_ids(generation_config(files), tokenizer), context_length(config, tokenizer)
    share = cache_gb / (len(files.folders) + 2) if "vllm-merged" in choice.engines else cache_gb

    def vllm(base: str, adapters: dict[str, str], own_name: str | None = None) -> VllmEngine:
        return VllmEngine(base, adapters, ends, context, dtype, max_rows, device.type == "cuda", share, threads,
                          files.revision if base == files.base else None, eager, own_name=own_name)
    folders = {name: str(folder) for name, folder in files.folders.items()}
    if "vllm" in choice.engines:
        started["vllm"] = vllm(files.base, folders if choice.adapters == "vllm" else {})
    if "vllm-merged" in choice.engines:
        started["vllm-merged"] = MergedAdapters(files.base, files.revision, folders, dtype,
                                                lambda merged, name: vllm(merged, {}, name))
    return Engines(started[choice.base], started[choice.adapters], choice)


def mergeable(choice: Choice, files: ServedFiles) -> Choice:
    """`choice`, or this project's engine for the adapters where one of them (or the base) does not merge: the
    driver checks the adapters it has; a registered version is known here first."""
    if choice.adapters != "vllm-merged":
        return choice
    problem = next(filter(None, map(merge_problem, files.folders.values())), None)
    if problem is None and Path(files.base).is_dir():
        why = base_model_problem(Path(files.base))
        problem = why and f"{files.base}: {why}"
    if problem is None:
        return choice
    log.warning("the adapters are served by this project's engine, not merged: %s", problem)
    return Choice(choice.base, "transformers", f"{choice.reason}; but {problem}: this project's engine")


@serve.deployment(**LIMITS)
@serve.ingress()
class ChatCompletions:
    def __init__(self, adapters: dict[str, str], choice: Choice, base: str | None = None, base_name: str = "base",
                 output_dir: str = "outputs", max_new_tokens: int = 64, key_sha256: str | None = None,
                 max_rows: int = 64, max_body_bytes: int = 1 << 20, follow_interval_s: float = 30.0,
                 threads: int | None = None, cache_gb: float = 4.0, dtype: str = "auto", eager: bool = False):
        if threads:
            torch.set_num_threads(threads)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        sources = {name: pinned(source) for name, source in adapters.items()}  # an alias: its version now
        files = served_files(sources, base, output_dir)
        self.tokenizer = load_tokenizer(files)
        config = AutoConfig.from_pretrained(files.base, revision=files.revision)
        context = context_length(config, self.tokenizer)
        engines = start_engines(choice, files, self.tokenizer, config, max_rows, cache_gb, device, threads,
                                dtype, eager)
        self.served = Served(engines, base_name, list(adapters), context, vocabulary_size(config), max_new_tokens,
                             labels={name: uri for name, uri in sources.items() if uri.startswith("models:/")})
        followed = {name: source for name, source in adapters.items() if source != sources[name]}
        if followed:
            first = sources[next(iter(followed))]
            follower = AliasFollower(self.served, followed, base_of(adapter_folder(first), first), follow_interval_s)
            self.served.reload = follower.check
        self.key_sha256, self.max_body_bytes = key_sha256, max_body_bytes

    def __del__(self):
        """Serve's graceful shutdown: the engines' processes stopped, merged copies deleted."""
        if hasattr(self, "served"):
            self.served.engines.close()

    def check_health(self) -> None:
        """Serve replaces a replica whose engine died (its in-flight requests failed with it)."""
        broken = self.served.engines.broken
        if broken:
            raise RuntimeError(f"the engine stopped: {broken}")

    def __serve_build_asgi_app__(self):
        return build_api(self.served, self.tokenizer, self.key_sha256, self.max_body_bytes)

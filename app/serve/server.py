"""OpenAI-compatible chat completions on Ray Serve: one base model, any number of LoRA adapters.

The request's `model` picks the adapter (multi-LoRA: PEFT holds every adapter beside the one base, and
a batch runs each row with its own); the base's own name answers without any. Adapters come from a
local folder, a run name under the output directory, or the MLflow Model Registry
(`models:/NAME/VERSION`, or `models:/NAME@ALIAS`: followed as the alias moves, app/serve/follow.py),
resolved by the replica itself, so it may run on any node that reaches the
storage or the tracking server. The HTTP API is app/serve/api.py (keys, limits, validation, streaming)
and generation app/serve/engine.py (transformers' `generate` on batches of concurrent requests): what
a CPU cluster runs; GPU clusters serve the same registered adapters with vLLM (cluster/serve-llm.yaml).
This module is Ray's edge: the deployment and its limits.
"""

from __future__ import annotations

from ray import serve

from app.serve.api import Served, build_api, context_length
from app.serve.engine import Engine
from app.serve.follow import AliasFollower
from app.serve.models import load
from app.tracking.adapters import adapter_folder, base_of, pinned

# Serve's defaults for a replica: concurrent requests (a batch is at most max_batch_size of them) and
# those queued beyond that (refused with 503 when full). jobs.serve sets both from its arguments.
LIMITS = {"max_ongoing_requests": 32, "max_queued_requests": 64}


@serve.deployment(**LIMITS)
@serve.ingress()
class ChatCompletions:
    def __init__(self, adapters: dict[str, str], base: str | None = None, base_name: str = "base",
                 output_dir: str = "outputs", max_new_tokens: int = 64, key_sha256: str | None = None,
                 max_batch_size: int = 8, max_body_bytes: int = 1 << 20, follow_interval_s: float = 30.0):
        sources = {name: pinned(source) for name, source in adapters.items()}  # an alias: its version now
        model, self.tokenizer = load(sources, base, output_dir)
        context = context_length(model, self.tokenizer)
        self.served = Served(Engine(model, self.tokenizer, max_batch_size, context), base_name, list(adapters),
                             context, max_new_tokens,
                             labels={name: uri for name, uri in sources.items() if uri.startswith("models:/")})
        followed = {name: source for name, source in adapters.items() if source != sources[name]}
        if followed:
            first = sources[next(iter(followed))]
            follower = AliasFollower(self.served, followed, base_of(adapter_folder(first), first), follow_interval_s)
            self.served.reload = follower.check
        self.key_sha256, self.max_body_bytes = key_sha256, max_body_bytes

    def __serve_build_asgi_app__(self):
        return build_api(self.served, self.tokenizer, self.key_sha256, self.max_body_bytes)

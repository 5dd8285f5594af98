"""torch.compile on the workers: inductor's caches where every rank, attempt and job of the storage finds them, and
`model.compile: auto` decided once on rank 0 (app/model/compile_choice.py) and taken by every rank."""

from __future__ import annotations

import sys

from app.config.schema import FinetuneConfig
from app.environment import shared_storage
from app.model.compile_choice import compile_cache_dir, decide_compile, use_compile_cache
from app.train.ranks import RankContext, max_over_ranks


def with_compile_resolved(cfg: FinetuneConfig, ctx: RankContext) -> tuple[FinetuneConfig, dict[str, float], str]:
    """The config with model.compile true or false, the start-up figure `compile_cache_warm` (1: inductor's cache
    held code before this run, so its layers load compiled code instead of compiling), and why auto chose (rank 0:
    measured or remembered)."""
    if cfg.model.compile is False:
        return cfg, {}, ""
    cache = compile_cache_dir(cfg.train.output_dir, shared_storage())
    warm = cache.is_dir() and any(p.name != "compile_choices.json" for p in cache.iterdir())
    use_compile_cache(cache)
    why = ""
    if cfg.model.compile == "auto":
        decided, why = decide_compile(cfg, ctx.device, cache) if ctx.is_main else (False, "")
        decided = bool(max_over_ranks(float(decided), ctx))  # rank 0's verdict, on every rank
        if ctx.is_main:
            print(f"auto: model.compile={str(decided).lower()} ({why})", file=sys.__stdout__, flush=True)  # as Progress
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"compile": decided})})
    return cfg, {"compile_cache_warm": float(warm)}, why

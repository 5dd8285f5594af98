"""What only the workers can decide, decided once at their start with every rank agreeing, into the run's plan
(app/plan/plan.py): the `auto` compute dtypes (bf16 only where every rank's hardware computes it natively) and
`model.compile: auto` (measured or remembered on rank 0, app/plan/compile_choice.py, and taken by every rank);
and inductor's caches where every rank, attempt and job of the storage finds them."""

from __future__ import annotations

import re
import sys

from app.environment import shared_storage
from app.model.hardware import has_fast_bf16
from app.plan.compile_choice import CHOICES_FILE, compile_cache_dir, decide_compile, use_compile_cache
from app.plan.dtypes import dtype_decisions
from app.plan.plan import MEASURED_ON_WORKERS, PER_RECORD_MODES, Decision, Plan, autos_left
from app.train.group import RankContext, max_over_ranks, on_every_rank


def measured_on_workers(plan: Plan, ctx: RankContext) -> tuple[Plan, dict[str, float]]:
    """The plan with nothing `auto` left but per-record modes, and the start-up figure `compile_cache_warm` (1:
    inductor's cache held code before this run, so its layers load compiled code instead of compiling)."""
    plan = plan.decided(*dtype_decisions(plan.cfg, on_every_rank(has_fast_bf16(ctx.device), ctx)))
    compiling, figures = compile_decision(plan, ctx)
    plan = plan.decided(*compiling)
    if left := [key for key in autos_left(plan.cfg) if key not in PER_RECORD_MODES]:
        raise RuntimeError(f"{left[0]}=auto reached the workers' step: the plan decides it before they build anything")
    if ctx.is_main:
        for key, why in plan.reasons.items():
            if key in MEASURED_ON_WORKERS:
                print(f"plan: {key}={why}", file=sys.__stdout__, flush=True)  # as Progress prints
    return plan, figures


def compile_decision(plan: Plan, ctx: RankContext) -> tuple[tuple[Decision, ...], dict[str, float]]:
    """model.compile where `auto`: rank 0's verdict (measured or remembered), taken by every rank; with inductor's
    cache set up wherever the layers may compile."""
    cfg = plan.cfg
    if cfg.model.compile is False:
        return (), {}
    cache = compile_cache_dir(cfg.train.output_dir, shared_storage())
    figures = {"compile_cache_warm": float(cache.is_dir() and any(p.name != CHOICES_FILE for p in cache.iterdir()))}
    use_compile_cache(cache)
    if cfg.model.compile is True:
        return (), figures
    if cfg.adapters:  # the layers' LoRA path changes with the adapter: each would compile anew
        return (Decision("model.compile", False, "false (adapters: each adapter's path would compile anew)"),), figures
    decided, why = decide_compile(cfg, ctx.device, cache) if ctx.is_main else (False, "")
    decided = bool(max_over_ranks(float(decided), ctx))  # rank 0's verdict, on every rank
    return (Decision("model.compile", decided, f"{str(decided).lower()} ({why})" if why else ""),), figures


def measured_params(plan: Plan) -> dict[str, object]:
    """MLflow params of what the workers decided: each value (`resolved.<key>`), and why where `auto` chose
    (`plan.<key>`; not whether the verdict was measured or remembered: a resumed run logs the same params)."""
    values = plan.cfg.flat()
    return ({f"resolved.{key}": values[key] for key in sorted(MEASURED_ON_WORKERS)}
            | {f"plan.{key}": re.sub(r"; (measured|remembered)\)$", ")", why) for key, why in plan.reasons.items()
               if key in MEASURED_ON_WORKERS})

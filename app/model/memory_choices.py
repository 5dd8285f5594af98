"""What `auto` resolves to for the choices that trade speed against memory, from the memory plan
(app/model/memory_plan.py) against one worker's memory budget: model.gradient_checkpointing (off, on every n-th
decoder layer, on every layer) and train.micro_batch_size. Plain arithmetic on the meta device: the budget comes
from the caller (the cluster's, or scaling.device_memory_gb), and a run whose explicit choices do not fit is
refused here, before any worker starts, rather than failing at its first step.

The order: the least recomputation first (recomputing a checkpointed layer costs about a third of its step, on
every step), then the largest micro-batch that fits with it (fewer, fuller passes); an explicit value is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.config.schema import FinetuneConfig
from app.errors import UserInputError
from app.model.memory_plan import GiB, MemoryPlan, checkpointed_layers, plan_memory, with_activations_of

USABLE = 0.9  # of a device's memory: CUDA context and allocator fragmentation take the rest (host: the OS, Ray)
Checkpointing = tuple[bool, int]  # (on, every n-th layer)


@dataclass(frozen=True)
class MemoryChoices:
    cfg: FinetuneConfig  # every auto of the three resolved (the most memory-saving where nothing fits)
    reasons: dict[str, str]  # config key -> the resolved value and why, for the log and the MLflow run
    plan: MemoryPlan  # of the resolved config
    refusal: str | None = None  # why nothing fits: the one-line error a launch stops with

    def fitting(self) -> MemoryChoices:
        if self.refusal:
            raise UserInputError(self.refusal)
        return self


def resolve_memory_choices(cfg: FinetuneConfig, budget_bytes: float, budget_source: str,
                           config_file: str | None = None) -> MemoryChoices:
    """The config with checkpointing and micro-batch resolved to the fastest that fits `budget_bytes`, or the
    most memory-saving with a refusal when nothing (or the explicit choice) fits."""
    base = plan_memory(_with(cfg, (False, 1), 1), config_file)  # planned once: only the activations vary
    auto_checkpointing = cfg.model.gradient_checkpointing == "auto"
    auto_micro = cfg.train.micro_batch_size == "auto"
    checkpointing = checkpointing_options(base.num_layers) if auto_checkpointing else [
        (cfg.model.gradient_checkpointing, cfg.model.checkpoint_every_n_layers)]
    micro_batches = micro_batch_options(cfg) if auto_micro else [cfg.train.micro_batch_size]
    usable = USABLE * budget_bytes
    for option in checkpointing:
        for micro in micro_batches:
            candidate = _with(cfg, option, micro)
            plan = with_activations_of(base, candidate)
            if plan.device_total <= usable:
                return MemoryChoices(candidate, _reasons(candidate, plan, usable, budget_source, auto_checkpointing,
                                                         auto_micro), plan)
    thriftiest = _with(cfg, checkpointing[-1], micro_batches[-1])
    plan = with_activations_of(base, thriftiest)
    return MemoryChoices(thriftiest, {}, plan, _does_not_fit(thriftiest, plan, usable, budget_source,
                                                            auto_checkpointing or auto_micro))


def checkpointing_options(num_layers: int) -> list[Checkpointing]:
    """From the least recomputation to the most: off, then every n-th layer for n from num_layers down to 1
    (one option per distinct count of checkpointed layers)."""
    options: list[Checkpointing] = [(False, 1)]
    counts: set[int] = set()
    for every in range(num_layers, 0, -1):
        count = math.ceil(num_layers / every)
        if count not in counts:
            counts.add(count)
            options.append((True, every))
    return options


def micro_batch_options(cfg: FinetuneConfig) -> list[int]:
    """Micro-batch sizes that split the global batch evenly on every group size the run may train with,
    largest first (train.global_batch_size counts completions with GRPO: the same rule)."""
    batch = cfg.train.global_batch_size
    per_rank = batch // cfg.scaling.num_workers
    return [size for size in range(per_rank, 0, -1)
            if all(batch % (size * workers) == 0 for workers in cfg.scaling.worker_counts)]


def _with(cfg: FinetuneConfig, checkpointing: Checkpointing, micro: int) -> FinetuneConfig:
    on, every = checkpointing
    model = cfg.model.model_copy(update={"gradient_checkpointing": on, "checkpoint_every_n_layers": every})
    return cfg.model_copy(update={"model": model,
                                  "train": cfg.train.model_copy(update={"micro_batch_size": micro})})


def _describe(cfg: FinetuneConfig, num_layers: int) -> str:
    count = checkpointed_layers(cfg.model, num_layers)
    ckpt = "off" if not count else f"on {count} of {num_layers} layers"
    return f"checkpointing {ckpt}, micro-batch {cfg.train.micro_batch_size}"


def _reasons(cfg: FinetuneConfig, plan: MemoryPlan, usable: float, source: str, auto_checkpointing: bool,
             auto_micro: bool) -> dict[str, str]:
    fits = f"{plan.device_total / GiB:.2f} GiB planned per worker, {usable / GiB:.1f} GiB usable ({source})"
    model, reasons = cfg.model, {}
    if auto_checkpointing:
        count = checkpointed_layers(model, plan.num_layers)
        value = "false" if not count else f"true, every {model.checkpoint_every_n_layers} layer(s)"
        why = ("fits without it" if not count else
               f"{count} of {plan.num_layers} layers checkpointed: the fewest that fit")
        reasons["model.gradient_checkpointing"] = f"{value} ({why}: {fits})"
    if auto_micro:
        reasons["train.micro_batch_size"] = (f"{cfg.train.micro_batch_size} (the largest that splits the global "
                                             f"batch and fits: {fits})")
    return reasons


def _does_not_fit(cfg: FinetuneConfig, plan: MemoryPlan, usable: float, source: str, auto: bool) -> str:
    tried = "the most memory-saving auto choice: " if auto else ""
    return (f"the memory plan needs {plan.device_total / GiB:.2f} GiB per worker ({tried}"
            f"{_describe(cfg, plan.num_layers)}), more than the {usable / GiB:.1f} GiB usable ({source}, 90%): set "
            "model.gradient_checkpointing and train.micro_batch_size to auto, add workers (parameters shard over "
            "them), or shorten data.max_seq_len; python -m jobs.plan shows the plan")

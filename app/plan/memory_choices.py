"""What `auto` resolves to for the choices that trade speed against memory, from the memory plan
(app/plan/memory.py) against one worker's memory budget: model.gradient_checkpointing (off, on every n-th
decoder layer, on every layer), train.micro_batch_size and scaling.mesh (every worker holding the whole model, or
its parameters sharded over all of them). Plain arithmetic on the meta device: the budget comes
from the caller (the cluster's, or scaling.device_memory_gb), and a run whose explicit choices do not fit is
refused here, before any worker starts, rather than failing at its first step.

The order: the least recomputation first (recomputing a checkpointed layer costs about a third of its step, on
every step), then the largest micro-batch that fits with it (fewer, fuller passes), then replicated before sharded
(a sharded step gathers every layer's weights, twice with reshard_after_forward; replicated, the workers exchange
only the LoRA gradients: 1.34x the sharded step on 2 CPU workers, docs/performance.md); an explicit value is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Literal

from app.config.schema import FinetuneConfig
from app.errors import UserInputError
from app.plan.memory import GiB, MemoryPlan, checkpointed_layers, plan_memory, with_activations_of
from app.plan.plan import Decision, applied

USABLE = 0.9  # of a device's memory: CUDA context and allocator fragmentation take the rest (host: the OS, Ray)
Checkpointing = tuple[bool, int]  # (on, every n-th layer)
Mesh = Literal["replicate"] | None  # what scaling.mesh=auto resolves to


@dataclass(frozen=True)
class MemoryChoices:
    cfg: FinetuneConfig  # the config with the choices (the most memory-saving where nothing fits)
    decisions: tuple[Decision, ...]  # every auto of the three, with the value and why (none where nothing fits)
    plan: MemoryPlan  # of `cfg`
    refusal: str | None = None  # why nothing fits: the one-line error a launch stops with

    @property
    def reasons(self) -> dict[str, str]:
        return {d.key: d.reason for d in self.decisions if d.reason}

    def fitting(self) -> tuple[Decision, ...]:
        if self.refusal:
            raise UserInputError(self.refusal)
        return self.decisions


MEMORY_KEYS = ("model.gradient_checkpointing", "train.micro_batch_size", "train.adapters_per_micro_batch",
               "scaling.mesh")  # the speed-for-memory choices the memory plan decides


def memory_autos(cfg: FinetuneConfig) -> list[str]:
    """The speed-for-memory keys the config leaves `auto`."""
    return [key for key in MEMORY_KEYS if getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) == "auto"]


def resolve_memory_choices(cfg: FinetuneConfig, budget_bytes: float, budget_source: str,
                           config_file: str | None = None) -> MemoryChoices:
    """Checkpointing, micro-batch and mesh decided: the fastest that fits `budget_bytes`, or the most
    memory-saving with a refusal when nothing (or the explicit choice) fits."""
    autos = set(memory_autos(cfg))
    checkpointing = [(cfg.model.gradient_checkpointing, cfg.model.checkpoint_every_n_layers)]
    micro_batches = micro_batch_options(cfg) if "train.micro_batch_size" in autos else [cfg.train.micro_batch_size]
    meshes = mesh_options(cfg) if "scaling.mesh" in autos else [cfg.scaling.mesh]
    shared = 1 if "train.adapters_per_micro_batch" in autos else cfg.train.adapters_per_micro_batch  # grown last
    bases = [plan_memory(_with(cfg, (False, 1), 1, mesh, shared), config_file) for mesh in meshes]  # activations vary
    if "model.gradient_checkpointing" in autos:
        checkpointing = checkpointing_options(bases[0].num_layers)
    usable = USABLE * budget_bytes
    for option, micro, (mesh, base) in product(checkpointing, micro_batches, zip(meshes, bases)):
        candidate = _with(cfg, option, micro, mesh, shared)
        plan = with_activations_of(base, candidate)
        if plan.device_total <= usable:
            if "train.adapters_per_micro_batch" in autos:
                candidate, plan = most_adapters_per_pass(candidate, base, usable)
            return MemoryChoices(candidate, _decisions(candidate, plan, usable, budget_source, autos), plan)
    thriftiest = _with(cfg, checkpointing[-1], micro_batches[-1], meshes[-1], shared)
    plan = with_activations_of(bases[-1], thriftiest)
    searched = bool(autos - {"train.adapters_per_micro_batch"})
    return MemoryChoices(thriftiest, (), plan, _does_not_fit(thriftiest, plan, usable, budget_source, searched))


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


def most_adapters_per_pass(cfg: FinetuneConfig, base: MemoryPlan, usable: float) -> tuple[FinetuneConfig, MemoryPlan]:
    """`cfg` (one adapter a pass) with as many adapters sharing each micro-batch as fit `usable`: fewer, fuller
    passes. DoRA adapters take a pass each."""
    most = 1 if cfg.lora.use_dora else len(cfg.adapters)
    for shared in range(most, 1, -1):
        candidate = applied(cfg, (Decision("train.adapters_per_micro_batch", shared),))
        plan = with_activations_of(base, candidate)
        if plan.device_total <= usable:
            return candidate, plan
    return cfg, with_activations_of(base, cfg)


def mesh_options(cfg: FinetuneConfig) -> list[Mesh]:
    """Replicated, then sharded over every worker; one worker has nothing to shard over."""
    return ["replicate", None] if cfg.scaling.num_workers > 1 else [None]


def _with(cfg: FinetuneConfig, checkpointing: Checkpointing, micro: int, mesh, shared: int) -> FinetuneConfig:
    """A candidate: `cfg` with these values, validated as a plan's config is."""
    on, every = checkpointing
    return applied(cfg, (Decision("model.gradient_checkpointing", on),
                         Decision("model.checkpoint_every_n_layers", every),
                         Decision("train.micro_batch_size", micro), Decision("scaling.mesh", mesh),
                         Decision("train.adapters_per_micro_batch", shared)))


def _describe(cfg: FinetuneConfig, num_layers: int) -> str:
    count = checkpointed_layers(cfg.model, num_layers)
    ckpt = "off" if not count else f"on {count} of {num_layers} layers"
    whole = ", every worker holding the whole model" if cfg.scaling.mesh == "replicate" else ""
    return f"checkpointing {ckpt}, micro-batch {cfg.train.micro_batch_size}{whole}"


def _decisions(cfg: FinetuneConfig, plan: MemoryPlan, usable: float, source: str,
               autos: set[str]) -> tuple[Decision, ...]:
    fits = f"{plan.device_total / GiB:.2f} GiB planned per worker, {usable / GiB:.1f} GiB usable ({source})"
    model, decided = cfg.model, []
    if "model.gradient_checkpointing" in autos:
        count = checkpointed_layers(model, plan.num_layers)
        value = "false" if not count else f"true, every {model.checkpoint_every_n_layers} layer(s)"
        why = ("fits without it" if not count else
               f"{count} of {plan.num_layers} layers checkpointed: the fewest that fit")
        decided += [Decision("model.gradient_checkpointing", model.gradient_checkpointing, f"{value} ({why}: {fits})"),
                    Decision("model.checkpoint_every_n_layers", model.checkpoint_every_n_layers)]
    if "train.micro_batch_size" in autos:
        micro = cfg.train.micro_batch_size
        decided.append(Decision("train.micro_batch_size", micro,
                                f"{micro} (the largest that splits the global batch and fits: {fits})"))
    if "train.adapters_per_micro_batch" in autos:  # without adapters: 1, nothing to say
        shared = cfg.train.adapters_per_micro_batch
        why = (f"{shared} of {len(cfg.adapters)} adapters' copies of each micro-batch in one forward (the most that "
               f"fit: {fits})")
        decided.append(Decision("train.adapters_per_micro_batch", shared, why if cfg.adapters else ""))
    if "scaling.mesh" in autos and cfg.scaling.mesh == "replicate":
        decided.append(Decision("scaling.mesh", "replicate",
                                f"replicate (every worker holds the whole model, no gathers: {fits})"))
    elif "scaling.mesh" in autos:
        # one worker has nothing to choose: replicated was never an option
        tried = "" if cfg.scaling.num_workers == 1 else "replicated does not fit with these choices; "
        decided.append(Decision("scaling.mesh", None, f"null (sharded over every worker: {tried}{fits})"))
    return tuple(decided)


def _does_not_fit(cfg: FinetuneConfig, plan: MemoryPlan, usable: float, source: str, auto: bool) -> str:
    tried = "the most memory-saving auto choice: " if auto else ""
    return (f"the memory plan needs {plan.device_total / GiB:.2f} GiB per worker ({tried}"
            f"{_describe(cfg, plan.num_layers)}), more than the {usable / GiB:.1f} GiB usable ({source}, 90%): set "
            "model.gradient_checkpointing, train.micro_batch_size and scaling.mesh to auto, add workers (parameters "
            "shard over them), or shorten data.max_seq_len; python -m jobs.plan shows the plan")

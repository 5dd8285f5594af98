"""How much memory one training worker has, asked of the cluster before launch, and the config's speed-for-memory
`auto` values decided against it (app/plan/memory_choices.py): a run that cannot fit stops here, not at its
first step."""

from __future__ import annotations

import ray
import torch
from ray.exceptions import GetTimeoutError

from app.config.schema import FinetuneConfig
from app.errors import UserInputError, first_line, warn
from app.plan.memory import GiB, MemoryPlan
from app.plan.memory_choices import USABLE, resolve_memory_choices
from app.plan.plan import Decision
from app.plan.rollout_sizing import rollout_gpus_each

GPU_PROBE_SECONDS = 120.0
# On CPU workers the peak measured 2.1-2.3x the plan (allocator cache, gloo and FSDP buffers: docs/performance.md,
# "Memory options"): a host budget is divided by this, so that `auto` plans against what a worker really holds.
HOST_PEAK_OVER_PLAN = 2.3


@ray.remote(num_gpus=1, num_cpus=0)
def gpu_memory_bytes() -> int:
    return torch.cuda.get_device_properties(0).total_memory


def worker_memory_budget(cfg: FinetuneConfig) -> tuple[float, str]:
    """(bytes, where the figure comes from): scaling.device_memory_gb if set; with GPUs one GPU's memory, asked of
    the cluster by a one-GPU task; with CPU workers the memory Ray lets tasks use on the smallest node that holds
    a worker, shared by the workers it holds, over the CPU's measured peak-to-plan ratio."""
    if cfg.scaling.device_memory_gb:
        return cfg.scaling.device_memory_gb * GiB, f"scaling.device_memory_gb={cfg.scaling.device_memory_gb:g}"
    if cfg.scaling.use_gpu:
        try:
            return float(ray.get(gpu_memory_bytes.remote(), timeout=GPU_PROBE_SECONDS)), "a GPU of the cluster"
        except GetTimeoutError:
            raise UserInputError(f"no GPU of the cluster was free within {GPU_PROBE_SECONDS:g} s to read its memory "
                                 "for the memory plan: set scaling.device_memory_gb (one GPU's GiB)") from None
    shares = []
    for node in ray.nodes():
        slots = int(node["Resources"].get("CPU", 0) // cfg.scaling.cpus_per_worker)
        if node["Alive"] and slots:
            shares.append(node["Resources"].get("memory", 0) / min(slots, cfg.scaling.num_workers))
    if not shares:
        raise UserInputError(f"scaling.cpus_per_worker={cfg.scaling.cpus_per_worker:g}: no node of the cluster has "
                             "that many CPUs; lower it, or add a larger node")
    return min(shares) / HOST_PEAK_OVER_PLAN, (f"Ray's task memory on the smallest node per worker it holds, "
                                               f"/ {HOST_PEAK_OVER_PLAN:g}: CPU peaks over plans")


def memory_decisions(cfg: FinetuneConfig) -> tuple[tuple[Decision, ...], MemoryPlan | None]:
    """Checkpointing, micro-batch and mesh decided where `auto` (app/plan/memory_choices.py), and the plan they
    make; a one-line error when the plan does not fit the worker's memory, or a rollout actor's its GPU. A model the
    planner cannot read (an architecture without the usual config fields) trains unchecked, its `auto` values the
    memory-saving ones (and no plan)."""
    budget = worker_memory_budget(cfg)
    try:
        choices = resolve_memory_choices(cfg, *budget)
    except UserInputError:
        raise
    except (AttributeError, KeyError, ValueError) as e:
        warn(f"the memory plan of {cfg.model.path} could not be made ({type(e).__name__}: {first_line(e, 200)}); "
             "the run is not checked against the workers' memory")
        return memory_saving_decisions(cfg), None
    decisions = choices.fitting()
    check_rollout_actors(cfg, choices.plan, *budget)
    return decisions, choices.plan


def check_rollout_actors(cfg: FinetuneConfig, plan: MemoryPlan, budget_bytes: float, source: str) -> None:
    """Rollout actors on GPUs beside GPU workers (the same GPUs, as the cluster's are alike): one actor's plan must
    fit one GPU, or the run stops here in one line. CPU actors share their node's memory with the workers; the
    plan prints what they take."""
    usable = USABLE * budget_bytes
    on_gpus = rollout_gpus_each(cfg) > 0 and (cfg.scaling.use_gpu or cfg.scaling.device_memory_gb)
    if not on_gpus or plan.rollout_actor_total <= usable:
        return
    raise UserInputError(
        f"rollout.workers: each rollout actor plans {plan.rollout_actor_total / GiB:.2f} GiB (the whole base, its "
        f"policy, the KV cache of the answers it decodes at once), more than the {usable / GiB:.1f} GiB usable of a "
        f"GPU ({source}, 90%): set rollout.batch_rows to decode fewer answers at once, shorten "
        "rollout.max_completion_tokens, or give the actors larger GPUs; python -m jobs.plan shows the plan")


def rollout_actor_line(plan: MemoryPlan | None) -> str | None:
    """What each rollout actor takes, as the driver prints it (None: nothing samples online, or no plan was made)."""
    if plan is None or not plan.rollout_actor:
        return None
    parts = "; ".join(f"{name} {value / GiB:.2f}" for name, value in plan.rollout_actor.items())
    host = "; ".join(f"{name} {value / GiB:.2f} GiB" for name, value in plan.rollout_actor_host.items())
    return (f"each rollout actor plans {plan.rollout_actor_total / GiB:.2f} GiB on its device ({parts} GiB)"
            + (f" and on its host: {host}" if host else "") + "; python -m jobs.plan shows the whole plan")


def memory_saving_decisions(cfg: FinetuneConfig) -> tuple[Decision, ...]:
    """Without a memory plan: checkpointing on every layer, micro-batches of one and parameters sharded over every
    worker, where they are auto."""
    why = "(no memory plan: the memory-saving choice)"
    decided = []
    if cfg.model.gradient_checkpointing == "auto":
        decided += [Decision("model.gradient_checkpointing", True, f"true {why}"),
                    Decision("model.checkpoint_every_n_layers", 1)]
    if cfg.train.micro_batch_size == "auto":
        decided.append(Decision("train.micro_batch_size", 1, f"1 {why}"))
    if cfg.train.adapters_per_micro_batch == "auto":
        decided.append(Decision("train.adapters_per_micro_batch", 1, f"1 {why}" if cfg.adapters else ""))
    if cfg.scaling.mesh == "auto":
        decided.append(Decision("scaling.mesh", None, "null (no memory plan: sharded over every worker, the "
                                                      "memory-saving choice)"))
    return tuple(decided)

"""The rollout actors of an objective that samples online (GRPO, distillation) sized against the trainers
(rollout.workers and rollout.gpus where `auto`), decided by the driver once it knows the cluster, and how the
policy reaches them (rollout.policy).

Beside CPU workers: one actor on CPUs. It shares the cores with the trainers, and a CPU decodes a batch about as
fast per answer at 32 rows as at 64 (docs/methods.md): a second actor would take from the trainers the
cores it adds. With GPU workers: a GPU per actor, as many actors as the cluster has GPUs beyond the trainers', at
most one per trainer (each actor decodes every rank's requests in one batch, so fewer than the trainers suffice
where decoding is memory-bound); none left is an error that says what to set. The decision prints with its
reason, the trainers beside the actors (`plan: rollout.workers=...`).
"""

from __future__ import annotations

from app.config.objectives import objective_of
from app.config.rollout import rollout_policy_of, vllm_refuses
from app.config.schema import FinetuneConfig
from app.errors import UserInputError
from app.model.vllm_support import vllm_cannot_run
from app.plan.plan import Decision

CPU_WHY = ("transformers (this project's engine: on CPUs, with the adapter merged, it samples 1.4-1.7x the answers/s "
           "of vLLM with the adapter merged too and 8-9x vLLM's LoRA requests on an AVX2 EPYC, and vLLM starts "
           "slower; benchmarks/rollouts.py)")


def rollout_gpus_each(cfg: FinetuneConfig) -> float:
    """GPUs each rollout actor takes: rollout.gpus, or for `auto` one with GPU workers, else none."""
    gpus = cfg.rollout.gpus
    return (1.0 if cfg.scaling.use_gpu else 0.0) if gpus == "auto" else float(gpus)


def rollout_workers_for(cfg: FinetuneConfig, cluster_gpus: float) -> tuple[int, str]:
    """The number of rollout actors and why, on a cluster of `cluster_gpus` GPUs."""
    asked, trainers, each = cfg.rollout.workers, cfg.scaling.num_workers, rollout_gpus_each(cfg)
    if asked != "auto":
        return asked, ""
    if not each:
        return 1, f"1 actor on {cfg.rollout.cpus:g} CPU beside {trainers} training workers (on CPUs a second " \
                  "would take the cores it adds from the trainers)"
    free = cluster_gpus - (trainers if cfg.scaling.use_gpu else 0)
    if free < each:
        raise UserInputError(f"rollout.workers=auto: the cluster's {cluster_gpus:g} GPUs all train "
                             f"(scaling.num_workers={trainers}); add a GPU for the rollout side, lower "
                             "scaling.num_workers, or set rollout.gpus=0 to sample on CPUs")
    count = max(1, min(int(free // each), trainers))
    return count, f"{count} actors with {each:g} GPU each beside {trainers} training workers on GPUs " \
                  f"({free:g} GPUs free of training)"


def rollout_decisions(cfg: FinetuneConfig, cluster_gpus: float) -> tuple[Decision, ...]:
    """rollout.workers, rollout.gpus, rollout.engine and rollout.policy decided (with no reason to print for a run
    that samples nothing online)."""
    online = objective_of(cfg.train).samples_online
    count, why = rollout_workers_for(cfg, cluster_gpus) if online else (1, "")
    decisions = []
    if cfg.rollout.workers == "auto":
        decisions.append(Decision("rollout.workers", count, why if online else ""))
    if cfg.rollout.gpus == "auto":
        decisions.append(Decision("rollout.gpus", rollout_gpus_each(cfg)))
    engine, why = rollout_engine_for(cfg, online)
    if cfg.rollout.engine == "auto":
        decisions.append(Decision("rollout.engine", engine, why if online else ""))
    if cfg.rollout.policy == "auto":
        policy, why = rollout_policy_of(cfg.model, cfg.lora, cfg.rollout, engine, on_gpu=rollout_gpus_each(cfg) > 0)
        decisions.append(Decision("rollout.policy", policy, why if online else ""))
    return tuple(decisions)


def check_asked_engine(cfg: FinetuneConfig) -> None:
    """rollout.engine=vllm where vLLM is not installed or cannot run the model: one line. The driver asks before
    Ray starts, once the plan knows the model's folder (app/launch/inputs.py)."""
    if cfg.rollout.engine != "vllm" or not objective_of(cfg.train).samples_online:
        return
    if cannot := vllm_cannot_run(cfg.model.path):
        raise UserInputError(f"rollout.engine=vllm: {cannot}; or set rollout.engine: transformers")


def rollout_engine_for(cfg: FinetuneConfig, online: bool) -> tuple[str, str]:
    """What decodes the rollouts, and why: vLLM on GPU actors where it runs the model (its paged attention and
    batched LoRA kernels are the fast path there), this project's engine on CPUs (benchmarks/rollouts.py: with the
    adapter merged it samples 1.4-1.7x vLLM with the adapter merged in its weights on an AVX2 EPYC) and wherever vLLM
    cannot run; `vllm` asked where it cannot run is one line."""
    asked = cfg.rollout.engine
    if asked == "transformers" or not online or (asked == "auto" and not rollout_gpus_each(cfg)):
        return "transformers", CPU_WHY if asked == "auto" and online else ""
    if asked == "vllm":
        check_asked_engine(cfg)
        return "vllm", ""
    refused = vllm_cannot_run(cfg.model.path) or vllm_refuses(cfg.model, cfg.lora) or \
        ("rollout.policy=merged, built for vLLM on CPU actors only" if cfg.rollout.policy == "merged" else None)
    if refused:
        return "transformers", f"transformers (this project's engine: {refused})"
    return "vllm", "vllm (GPU actors: vLLM's paged attention and batched LoRA kernels; the policy as LoRA requests)"


"""The rollout side on Ray (GRPO, distillation): actors that sample answers, apart from the training workers, and
GRPO's reward scoring as Ray tasks beside them.

The driver starts `rollout.workers` RolloutActor actors (each with its own CPUs, or GPUs on a GPU cluster),
each holding the frozen base once and an engine (app/train/rollout_engine.py) that decodes every rank's requests
in one continuously refilled batch. Every rank's prompts of a step are shared out over all the actors (whole
groups of answers each). After each optimizer step the training ranks gather the adapter's full weights from
their FSDP2 shards and each rank puts them in the object store; its requests carry that reference, the step and
the checksum the trainers computed, and an actor fetches the weights (a few MB, never the base) only when it does
not hold them yet, and checks them before it samples. Each answer comes back with the step and checksum of the
adapter that sampled it, which the trainer checks (app/train/rollouts.py). With rollout.max_staleness the actors
sample the next steps' prompts while the trainers train. An engine that hot-loads LoRA adapters (vLLM) could take
an actor's place behind the same call, `sample`; this one is the project's own decoding loop over transformers'
KV cache, which runs wherever the trainer does.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable

import numpy as np
import ray
import torch

from app.config.schema import FinetuneConfig
from app.plan.rollout_sizing import rollout_gpus_each
from app.train import rewards
from app.train.rollout_engine import RolloutEngine
from app.train.sampling import Sampled, build_sampler
from app.train.vllm_sampler import VllmSampler


@ray.remote(max_restarts=-1, max_task_retries=-1)
class RolloutActor:
    """One rollout worker: an engine over a Sampler (or vLLM, rollout.engine=vllm) on its own device (the
    name in the Ray dashboard's actor list), called from a thread per request. Ray restarts one that dies (a lost
    node); its first answer after that says so (rollout/actor_restarts), and the requests carry their adapter, so
    nothing is re-sent."""

    def __init__(self, cfg: FinetuneConfig):
        torch.set_num_threads(max(1, int(cfg.rollout.cpus)))
        device = "cuda" if rollout_gpus_each(cfg) and torch.cuda.is_available() else "cpu"
        sampler = (VllmSampler(cfg, device, own_process=True) if cfg.rollout.engine == "vllm"
                   else build_sampler(cfg, device))
        self.engine = RolloutEngine(sampler, cfg.rollout)  # its adapter: each request's
        with warnings.catch_warnings():  # Ray's own property reads its deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.told = threading.Lock()  # one of the threads answering says it restarted

    def sample(self, prompts: list[list[int]], seed: int, first: int, version: int, checksum: str,
               adapter: list) -> Sampled:
        """The answers, sampled with the adapter of step `version` (`adapter`: its weights' reference, in a list so
        that Ray fetches them only when this actor does not hold them)."""
        sampled = self.engine.sample(prompts, seed, first, version, checksum, lambda: ray.get(adapter[0]))
        with self.told:
            sampled.restarts, self.restarted = int(self.restarted), False
        return sampled


def start_rollout_group(cfg: FinetuneConfig) -> list:
    """The rollout actors, each reserving rollout.cpus CPUs and rollout.gpus GPUs, with a thread for
    every request the ranks may have open at once; returned once every one holds its model (a failure to build
    one is raised here, before the worker group starts). They sample nothing before the trainer's first request,
    which carries the adapter the run starts from (model.init_adapter's, or a checkpoint's)."""
    rollout = cfg.rollout
    requests = cfg.scaling.num_workers * (1 + rollout.max_staleness) + 1
    actors = [RolloutActor.options(num_cpus=rollout.cpus, num_gpus=rollout_gpus_each(cfg),
                                   max_concurrency=requests).remote(cfg) for _ in range(rollout.workers)]
    ray.get([actor.__ray_ready__.remote() for actor in actors])
    return actors


def stop_rollout_group(actors: list) -> None:
    """The run's rollout actors ended with it, whether it finished or failed: a failed run's handles live on (its
    Ray Train controller keeps the train function that holds them while the driver holds the run's error: a
    notebook, a test session), and Ray would keep each actor, its base and its engine (GBs with vLLM) until they
    are let go. `max_restarts` does not bring a killed one back."""
    for actor in actors:
        ray.kill(actor, no_restart=True)


class RayRollouts:
    """Rollouts (app/train/rollouts.py) over the rollout actors, as one training rank sees them."""

    def __init__(self, actors: list, rank: int, num_generations: int):
        self.actors, self.rank, self.num_generations = actors, rank, num_generations
        self.adapter, self.version, self.checksum = None, -1, ""  # the adapter sent last: in the store, step

    def sync(self, weights: dict[str, torch.Tensor], version: int, checksum: str) -> None:
        """This rank puts the weights (every rank holds them whole) in the object store; its next requests carry
        them. (A reference handed over by another rank could not be passed on: Ray refuses a reference whose owner
        it does not know.)"""
        self.adapter, self.version, self.checksum = ray.put(weights), version, checksum

    def submit(self, prompts: list[list[int]], seed: int, version: int) -> Callable[[], Sampled]:
        """The prompts shared out over the actors (this rank's first share to actor `rank`), sampling started with
        the adapter synced last (the trainer asks for that one: `version`, which it checks in the answers); the
        call returns every share's answers in the prompts' order."""
        shares = np.array_split(np.arange(len(prompts)), min(len(self.actors), len(prompts)))
        pending = [self.actors[(self.rank + i) % len(self.actors)].sample.remote(
            prompts[share[0]:share[-1] + 1], seed, int(share[0]) * self.num_generations, self.version, self.checksum,
            [self.adapter]) for i, share in enumerate(shares)]
        return lambda: joined(ray.get(pending))


def joined(parts: list[Sampled]) -> Sampled:
    """The answers of a request's shares as one; none (which the trainer refuses) if two shares were sampled with
    different adapters."""
    first = parts[0]
    if any((p.version, p.checksum) != (first.version, first.checksum) for p in parts):
        other = next(p for p in parts if (p.version, p.checksum) != (first.version, first.checksum))
        return Sampled(None, other.version, other.checksum)
    return Sampled([c for p in parts for c in p.completions], first.version, first.checksum,
                   sum(p.idle_seconds for p in parts) / len(parts), sum(p.restarts for p in parts))


@ray.remote(num_cpus=1)
def _score_task(specs: list[str], prompts: list, completions: list, completion_ids: list, columns: dict,
                first: int) -> np.ndarray:
    return rewards.score(specs, prompts, completions, completion_ids, columns, first)


def ray_scorer(specs: list[str], tasks: int):
    """A Scorer that splits a batch of answers over `tasks` Ray tasks (grpo.reward_workers): slow reward functions
    run side by side, beside the training workers."""
    def score(prompts: list, completions: list, completion_ids: list, columns: dict, first: int) -> np.ndarray:
        bounds = np.linspace(0, len(prompts), min(tasks, len(prompts)) + 1).astype(int)
        parts = [_score_task.remote(specs, prompts[a:b], completions[a:b], completion_ids[a:b],
                                    {k: v[a:b] for k, v in columns.items()}, first + a)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        return np.concatenate(ray.get(parts), axis=0)
    return score


def local_scorer(specs: list[str]):
    """A Scorer that calls the reward functions in the training worker itself."""
    return functools.partial(rewards.score, specs)

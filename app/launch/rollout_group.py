"""GRPO's rollout side on Ray: actors that sample answers, apart from the training workers, and reward scoring as
Ray tasks beside them.

The driver starts `grpo.rollout_workers` RolloutActor actors (each with its own CPUs, or GPUs on a GPU cluster),
each holding the frozen base once and the policy's adapter (app/train/sampling.py). After each optimizer step
the training ranks gather the adapter's full weights from their FSDP2 shards, each rank puts them in the object
store and its actor swaps them in before that rank's next request, checked against the checksum
the trainers computed: a few MB, never the base. Rank r samples with actor r (modulo the group); each answer
comes back with the step and checksum of the adapter that sampled it, which the trainer checks
(app/train/rollouts.py). With grpo.max_staleness the actors sample the next steps' prompts while the trainers
train (an actor runs one caller's calls one at a time, in order). An engine that hot-loads LoRA adapters (vLLM)
can take the actors' place behind the same two calls, `load` and `sample`; this one is transformers' batched
`generate`, which runs wherever the trainer does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import ray
import torch

from app.config.schema import FinetuneConfig
from app.train import rewards
from app.train.sampling import Sampled, build_sampler


@ray.remote(max_restarts=-1, max_task_retries=-1)
class RolloutActor:
    """One rollout worker: a Sampler on its own device (the name in the Ray dashboard's actor list). Ray restarts
    one that dies (a lost node); it then holds the starting adapter again, which `sample` tells its caller, who
    sends the current one."""

    def __init__(self, cfg: FinetuneConfig):
        torch.set_num_threads(max(1, int(cfg.grpo.rollout_cpus)))
        device = "cuda" if cfg.grpo.rollout_gpus and torch.cuda.is_available() else "cpu"
        self.grpo, self.sampler = cfg.grpo, build_sampler(cfg, device)  # its adapter: the trainer's, at each sync

    def load(self, weights: dict[str, torch.Tensor], version: int, checksum: str) -> str:
        """The adapter of step `version`, checked against what the trainer sent; the checksum it holds."""
        self.sampler.load_adapter(weights, version, checksum)
        return self.sampler.checksum

    def sample(self, prompts: list[list[int]], seed: int, version: int) -> Sampled:
        """The answers, sampled with the adapter of step `version` (none if this actor holds another one)."""
        return self.sampler.sample_with(prompts, self.grpo, seed, version)


def start_rollout_group(cfg: FinetuneConfig) -> list:
    """The rollout actors, each reserving grpo.rollout_cpus CPUs and grpo.rollout_gpus GPUs; returned once every
    one holds its model (a failure to build one is raised here, before the worker group starts). They sample
    nothing before the trainer's first sync, which sends the adapter the run starts from (model.init_adapter's,
    or a checkpoint's)."""
    grpo = cfg.grpo
    actors = [RolloutActor.options(num_cpus=grpo.rollout_cpus, num_gpus=grpo.rollout_gpus).remote(cfg)
              for _ in range(grpo.rollout_workers)]
    ray.get([actor.__ray_ready__.remote() for actor in actors])
    return actors


class RayRollouts:
    """Rollouts (app/train/rollouts.py) over the rollout actors, as one training rank sees them."""

    def __init__(self, actors: list, rank: int):
        self.actors, self.rank = actors, rank
        self.actor = actors[rank % len(actors)]
        self.weights, self.version, self.checksum = None, -1, ""  # the adapter the actors hold: in the store, step
        self.loaded = None  # this rank's last load call to its actor

    def sync(self, weights: dict[str, torch.Tensor], version: int, checksum: str) -> None:
        """This rank puts the weights (every rank holds them whole) in the object store, asks its actor to load them
        and goes on: an actor runs one caller's calls in order, so this rank's next requests find them loaded (an
        actor that two ranks share loads them twice: a few MB), and nobody waits for an actor still sampling what
        was asked before. (A reference handed over by another rank could not be passed on: Ray refuses a reference
        whose owner it does not know.)"""
        self.weights, self.version, self.checksum = ray.put(weights), version, checksum
        self.loaded = self.actor.load.remote(self.weights, version, checksum)

    def submit(self, prompts: list[list[int]], seed: int, version: int) -> Callable[[], Sampled]:
        """Sampling starts on this rank's actor (after what it was asked before); the call returns its answers (or
        raises why the adapter's load before them was refused). An actor found restarted (it holds the starting
        adapter again) gets the current one and samples anew."""
        loaded, pending = self.loaded, self.actor.sample.remote(prompts, seed, version)

        def result() -> Sampled:
            if loaded is not None:
                ray.get(loaded)
            sampled = ray.get(pending)
            if sampled.completions is None and sampled.version == -1:
                ray.get(self.actor.load.remote(self.weights, self.version, self.checksum))
                sampled = ray.get(self.actor.sample.remote(prompts, seed, self.version))
                sampled.restarts = 1
            return sampled
        return result


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
